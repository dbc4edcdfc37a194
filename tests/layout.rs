//! Issue 11's limits on the code's shape, held by a test: no source file over 800 lines, no function
//! over 120 lines, `main.rs` under 200 lines. A file or function that grows past them is split
//! before it is merged, not after.

use std::path::{Path, PathBuf};

const MAX_FILE_LINES: usize = 800;
const MAX_FN_LINES: usize = 120;
const MAX_MAIN_LINES: usize = 200;

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `(name, first line, lines)` of every `fn` with a body: from its signature to the closing brace
/// at the signature's indentation (rustfmt's layout).
fn functions(text: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let indent = line.len() - line.trim_start().len();
        let words: Vec<&str> = line.split_whitespace().collect();
        let fn_at = words.iter().position(|w| *w == "fn");
        let is_fn = fn_at.is_some_and(|k| {
            words[..k].iter().all(|w| {
                matches!(*w, "pub" | "const" | "async" | "unsafe" | "extern")
                    || w.starts_with("pub(")
                    || w.starts_with('"')
            })
        });
        if !is_fn {
            i += 1;
            continue;
        }
        let name = words[fn_at.unwrap_or(0) + 1]
            .split(['(', '<'])
            .next()
            .unwrap_or_default()
            .to_string();
        // A declaration without a body (trait method) ends in `;` before any `{`.
        let mut j = i;
        while j < lines.len() && !lines[j].contains('{') && !lines[j].trim_end().ends_with(';') {
            j += 1;
        }
        if j >= lines.len() || !lines[j].contains('{') {
            i = j + 1;
            continue;
        }
        let closing = " ".repeat(indent) + "}";
        let one_line = lines[j].trim_end().ends_with('}');
        let mut k = j;
        if !one_line {
            k = j + 1;
            while k < lines.len() && !lines[k].starts_with(&closing) {
                k += 1;
            }
        }
        out.push((name, i + 1, k - i + 1));
        i = k + 1;
    }
    out
}

#[test]
fn no_file_or_function_outgrows_its_limit() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    sources(&root.join("src"), &mut files);
    assert!(files.len() > 20, "{} source files found", files.len());
    let mut over = Vec::new();
    let mut measured = 0;
    for f in &files {
        let text = std::fs::read_to_string(f).expect("read");
        let rel = f.strip_prefix(root).unwrap_or(f).display().to_string();
        let n = text.lines().count();
        let limit = if rel == "src/main.rs" {
            MAX_MAIN_LINES
        } else {
            MAX_FILE_LINES
        };
        if n > limit {
            over.push(format!("{rel}: {n} lines (limit {limit})"));
        }
        let fns = functions(&text);
        measured += fns.len();
        for (name, at, len) in fns {
            if len > MAX_FN_LINES {
                over.push(format!(
                    "{rel}:{at} fn {name}: {len} lines (limit {MAX_FN_LINES})"
                ));
            }
        }
    }
    // The scanner must see the code: a regex gone blind would pass everything.
    assert!(measured > 500, "only {measured} functions found");
    assert!(over.is_empty(), "{}", over.join("\n"));
}

#[test]
fn the_function_scanner_measures_what_rustfmt_writes() {
    let text = "pub fn a() {\n    x();\n}\n\nimpl T {\n    pub(crate) fn b<S>(\n        s: S,\n    ) -> u8 {\n        1\n    }\n    fn c(&self);\n    fn d() {}\n}\n";
    let f = functions(text);
    assert_eq!(
        f,
        vec![
            ("a".to_string(), 1, 3),
            ("b".to_string(), 6, 5),
            ("d".to_string(), 12, 1)
        ]
    );
}
