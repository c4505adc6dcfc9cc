//! The Python client's test script (clients/python/tests/stack_test.py), run against a stack
//! with set-up's .cache/pyclient Python.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

/// Runs the script with `args`; on its `KILL` line, calls `on_kill`. Returns its output.
pub async fn run_python_client(args: &[&str], mut on_kill: impl FnMut()) -> String {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let python = root.join(".cache/pyclient/bin/python");
    assert!(
        python.exists(),
        "{} missing: run `make setup`",
        python.display()
    );
    let mut child = tokio::process::Command::new(&python)
        .arg(root.join("clients/python/tests/stack_test.py"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut out = String::new();
    let read = async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line == "KILL" {
                on_kill();
            }
            out.push_str(&line);
            out.push('\n');
        }
    };
    tokio::time::timeout(Duration::from_secs(300), read)
        .await
        .expect("the Python client's script ran for 5 minutes");
    let done = child.wait_with_output().await.unwrap();
    assert!(
        done.status.success(),
        "stack_test.py {args:?} failed:\n{out}\n{}",
        String::from_utf8_lossy(&done.stderr)
    );
    out
}
