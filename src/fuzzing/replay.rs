//! The fuzz corpus (`fuzz/corpus/<target>/`) and the crash inputs kept as
//! regressions (`fuzz/regressions/<target>/`) replayed through the targets'
//! entry points: every input that ever found a bug stays a test.

use std::path::Path;

fn replay(target: &str, run: impl Fn(&[u8])) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut count = 0;
    for dir in [root.join("corpus").join(target), root.join("regressions").join(target)] {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        let mut files: Vec<_> = entries.map(|e| e.expect("a directory entry").path()).collect();
        files.sort();
        for file in files {
            let data = std::fs::read(&file).expect("a corpus file");
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&data)));
            assert!(outcome.is_ok(), "{target}: {} fails", file.display());
            count += 1;
        }
    }
    assert!(count > 0, "{target}: no corpus in fuzz/corpus/{target}");
}

#[test]
fn client_hello_corpus() {
    replay("client_hello", super::client_hello);
}

#[test]
fn proxy_header_corpus() {
    replay("proxy_header", super::proxy_header);
}

#[test]
fn ws_frames_corpus() {
    replay("ws_frames", super::ws_frames);
}

#[test]
fn mux_frames_corpus() {
    replay("mux_frames", super::mux_frames);
}

#[test]
fn htpasswd_corpus() {
    replay("htpasswd", super::htpasswd);
}

#[test]
fn api_json_corpus() {
    replay("api_json", super::api_json);
}

#[test]
fn api_request_corpus() {
    let dir = tempfile::tempdir().unwrap();
    let api = super::ApiFuzz::open(dir.path());
    replay("api_request", |data| api.request(data));
}

#[test]
fn http_head_corpus() {
    replay("http_head", super::http_head);
}

#[test]
fn h1_response_corpus() {
    replay("h1_response", super::h1_response);
}
