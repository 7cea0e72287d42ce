//! The configuration file as text, before and beside the YAML parser:
//! bounds checked in one linear pass before parsing (size, nesting depth:
//! the parser's time grows with the square of the depth, so a small file
//! of nested brackets could otherwise hold a reload for minutes), the
//! line of the first invalid UTF-8 byte, and (from the policies crate)
//! the line of a key, so that errors found after parsing (a value out of
//! range) name their line too.

/// The largest configuration file accepted.
pub const MAX_CONFIG_BYTES: usize = 16 << 20;
/// The deepest nesting accepted, of flow collections (`[`, `{`) and of
/// indented blocks alike. Real files nest fewer than ten levels.
pub const MAX_CONFIG_DEPTH: usize = 64;

/// The 1-based line of byte `offset` in `bytes`.
pub fn line_of(bytes: &[u8], offset: usize) -> usize {
    1 + bytes[..offset.min(bytes.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
}

/// Reads a configuration file's bytes as text: refused when larger than
/// [`MAX_CONFIG_BYTES`] or not UTF-8 (with the line of the first bad byte).
pub fn text(bytes: &[u8]) -> Result<&str, String> {
    if bytes.len() > MAX_CONFIG_BYTES {
        return Err(format!(
            "the file is {} bytes; a configuration may be at most {MAX_CONFIG_BYTES}",
            bytes.len()
        ));
    }
    std::str::from_utf8(bytes).map_err(|e| {
        format!(
            "line {}: not UTF-8 (byte {} of the file)",
            line_of(bytes, e.valid_up_to()),
            e.valid_up_to() + 1
        )
    })
}

/// Checks what must hold before the text goes to the parser: its size,
/// that it is not empty, and its nesting depth.
pub fn precheck(source: &str) -> Result<(), String> {
    if source.len() > MAX_CONFIG_BYTES {
        return Err(format!(
            "the file is {} bytes; a configuration may be at most {MAX_CONFIG_BYTES}",
            source.len()
        ));
    }
    if source
        .lines()
        .all(|l| l.trim().is_empty() || l.trim_start().starts_with('#'))
    {
        return Err(
            "the file is empty (a truncated write?); write `{}` to run on every default".into(),
        );
    }
    let mut indents: Vec<usize> = Vec::new();
    for (n, line) in source.lines().enumerate() {
        let body = line.trim_start_matches(' ');
        if body.is_empty() || body.starts_with('#') {
            continue;
        }
        let indent = line.len() - body.len();
        while indents.last().is_some_and(|&i| i >= indent) {
            indents.pop();
        }
        indents.push(indent);
        if indents.len() > MAX_CONFIG_DEPTH {
            return Err(format!(
                "line {}: nested more than {MAX_CONFIG_DEPTH} levels deep",
                n + 1
            ));
        }
    }
    flow_depth(source)
}

/// The deepest nesting of `[` and `{` outside quotes and comments.
fn flow_depth(source: &str) -> Result<(), String> {
    let bytes = source.as_bytes();
    let mut depth = 0usize;
    let mut line = 1;
    let mut i = 0;
    // Whether the previous byte lets a quote or a comment start here.
    let mut boundary = true;
    while i < bytes.len() {
        let b = bytes[i];
        match b {
            b'\n' => {
                line += 1;
                boundary = true;
                i += 1;
                continue;
            }
            b'#' if boundary => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
                continue;
            }
            b'\'' | b'"' if boundary => {
                let quote = b;
                i += 1;
                while i < bytes.len() {
                    match bytes[i] {
                        b'\\' if quote == b'"' => i += 1,
                        b'\n' => line += 1,
                        c if c == quote => {
                            // '' inside single quotes is an escaped quote.
                            if quote == b'\'' && bytes.get(i + 1) == Some(&b'\'') {
                                i += 1;
                            } else {
                                break;
                            }
                        }
                        _ => {}
                    }
                    i += 1;
                }
            }
            b'[' | b'{' => {
                depth += 1;
                if depth > MAX_CONFIG_DEPTH {
                    return Err(format!(
                        "line {line}: brackets nested more than {MAX_CONFIG_DEPTH} levels deep"
                    ));
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        boundary = matches!(b, b' ' | b'\t' | b'[' | b'{' | b',' | b':' | b'-');
        i += 1;
    }
    Ok(())
}

pub use kvedge_policies::yaml::key_line;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_found_under_their_parents() {
        let src = "# top\nrouter:\n  max_workers: 1\ndaemon:\n  # limits\n  ring_capacity: 4096\n  max_workers: 3\nlog: {}\n";
        assert_eq!(key_line(src, &["daemon", "max_workers"]), Some(7));
        assert_eq!(key_line(src, &["router", "max_workers"]), Some(3));
        assert_eq!(key_line(src, &["log", "level"]), Some(8));
        assert_eq!(
            key_line("daemon: {max_workers: 0}\n", &["daemon", "max_workers"]),
            Some(1)
        );
        assert_eq!(key_line(src, &["metrics"]), None);
    }

    #[test]
    fn deep_nesting_is_refused_in_linear_time_and_quotes_do_not_count() {
        let deep = format!("policy: {}{}\n", "[".repeat(100_000), "]".repeat(100_000));
        assert!(
            precheck(&deep)
                .unwrap_err()
                .starts_with("line 1: brackets nested")
        );
        let fine = format!(
            "policy: '{}'\n# {}\nx: \"[[\\\"\"\n",
            "[".repeat(500),
            "{".repeat(500)
        );
        assert!(precheck(&fine).is_ok());
        let mut blocks = String::new();
        for d in 0..70 {
            blocks.push_str(&" ".repeat(d));
            blocks.push_str("a:\n");
        }
        assert!(
            precheck(&blocks)
                .unwrap_err()
                .contains("line 65: nested more than 64")
        );
    }

    #[test]
    fn empty_oversized_and_non_utf8_files_are_refused_with_lines() {
        assert!(
            precheck("\n# only a comment\n")
                .unwrap_err()
                .contains("empty")
        );
        assert!(precheck("{}\n").is_ok());
        assert_eq!(
            text(b"a: 1\nb: \xff\n").unwrap_err(),
            "line 2: not UTF-8 (byte 9 of the file)"
        );
        assert!(
            text(&vec![b' '; MAX_CONFIG_BYTES + 1])
                .unwrap_err()
                .contains("at most")
        );
    }
}
