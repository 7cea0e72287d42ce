//! The chat template's Jinja environment, as transformers'
//! `apply_chat_template` (which vLLM and SGLang render through) builds it:
//! `trim_blocks` and `lstrip_blocks` on, loop controls, Python's string and
//! dict methods, `raise_exception`, `strftime_now`, and a `tojson` that is
//! Python's `json.dumps` (non-ASCII kept, `", "` and `": "` separators,
//! `indent`, `separators` and `sort_keys` as keywords) rather than Jinja's
//! HTML-safe one. A multi-line template rendered without the first two
//! gives a prompt the engine never sees, so no block hash would match.

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};

/// The environment with `source` as its `chat` template.
pub fn environment(source: String) -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", |format: String| {
        strftime(&format, now_utc())
    });
    env.add_filter("tojson", tojson);
    // Python prints a list or a dict as its repr (`{'a': True}`), where
    // minijinja would write JSON.
    env.set_formatter(|out, state, value| match python_repr(value) {
        Some(text) => out.write_str(&text).map_err(Error::from),
        None => minijinja::escape_formatter(out, state, value),
    });
    env.add_filter("string", |value: Value| -> Value {
        match python_repr(&value) {
            Some(text) => Value::from(text),
            None if value.is_undefined() => Value::from(""),
            None => Value::from(value.to_string()),
        }
    });
    env.add_template_owned("chat", without_generation_tags(&source))?;
    Ok(env)
}

/// What in `source` kvedge cannot render as transformers does, each
/// named (`filter \`wordwrap\``, `method \`.format()\``), and what it
/// renders differently (`strftime_now`, in UTC): for `kvedge
/// check-config` to warn of. A filter, test or method is probed in the
/// environment itself, so the list follows what minijinja supports.
pub fn unsupported(source: &str) -> Vec<String> {
    let Ok(env) = environment(String::new()) else {
        return Vec::new();
    };
    let probe = |template: String| match env.render_str(&template, minijinja::context! {}) {
        Err(e) => !matches!(
            e.kind(),
            ErrorKind::UnknownFilter | ErrorKind::UnknownTest | ErrorKind::UnknownMethod
        ),
        Ok(_) => true,
    };
    let mut out: Vec<String> = Vec::new();
    let mut note = |what: String| {
        if !out.contains(&what) {
            out.push(what);
        }
    };
    for code in code_spans(source) {
        let words = |after: &str| -> Vec<String> {
            code.match_indices(after)
                .filter_map(|(at, _)| {
                    let rest = code[at + after.len()..].trim_start();
                    let rest = rest.strip_prefix("not ").map_or(rest, str::trim_start);
                    let word: String = rest
                        .chars()
                        .take_while(|c| *c == '_' || c.is_ascii_alphanumeric())
                        .collect();
                    (!word.is_empty() && !word.starts_with(|c: char| c.is_ascii_digit()))
                        .then_some(word)
                })
                .collect()
        };
        for f in words("|") {
            if !probe(format!("{{{{ none | {f} }}}}")) {
                note(format!("filter `{f}`"));
            }
        }
        for t in words(" is ") {
            if !probe(format!("{{{{ none is {t} }}}}")) {
                note(format!("test `{t}`"));
            }
        }
        for (at, _) in code.match_indices('.') {
            let name: String = code[at + 1..]
                .chars()
                .take_while(|c| *c == '_' || c.is_ascii_alphanumeric())
                .collect();
            if name.is_empty() || !code[at + 1 + name.len()..].starts_with('(') {
                continue;
            }
            let known = ["'a'", "{}", "[]"]
                .iter()
                .any(|v| probe(format!("{{{{ {v}.{name}() }}}}")));
            if !known {
                note(format!("method `.{name}()`"));
            }
        }
    }
    if source.contains("strftime_now") {
        note(
            "`strftime_now` gives kvedge the date in UTC and the engine its host's local date \
             (run the engine with TZ=UTC)"
                .into(),
        );
    }
    out
}

/// The code of every `{{ }}` and `{% %}` in `source`, strings blanked so
/// that their text is not read as code.
fn code_spans(source: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = source;
    loop {
        let next = ["{{", "{%"]
            .iter()
            .filter_map(|open| rest.find(open).map(|at| (at, *open)))
            .min();
        let Some((at, open)) = next else {
            break;
        };
        let close = if open == "{{" { "}}" } else { "%}" };
        let body = &rest[at + 2..];
        let Some(end) = body.find(close) else {
            break;
        };
        let mut code = String::with_capacity(end);
        let mut quote = None;
        let mut escaped = false;
        for c in body[..end].chars() {
            match quote {
                Some(_) if escaped => {
                    escaped = false;
                    code.push(' ');
                }
                Some(_) if c == '\\' => {
                    escaped = true;
                    code.push(' ');
                }
                Some(q) if c == q => {
                    quote = None;
                    code.push(c);
                }
                Some(_) => code.push(' '),
                None => {
                    if c == '\'' || c == '"' {
                        quote = Some(c);
                    }
                    code.push(c);
                }
            }
        }
        out.push(code);
        rest = &body[end + 2..];
    }
    out
}

/// Whether the template loops over a message's content, as vLLM tells
/// (from the template's syntax tree) whether to hand it each content as a
/// list of parts: a `for` over `m.content` (or `m['content']`, sliced or
/// filtered) where `m` is a loop variable over `messages` (or over a name
/// set from it), a `for` over a bare `content` outside macros, or a `for`
/// inside a macro over a parameter some call fills with a message's
/// content. Read from the tags' text: minijinja keeps its syntax tree to
/// itself.
pub fn loops_over_content(source: &str) -> bool {
    let tags = statements(source);
    // Names that hold the messages: `messages`, and any set from one.
    let mut lists = vec!["messages".to_owned()];
    let mut i = 0;
    while i < lists.len() {
        for t in &tags {
            if let Some((name, expr)) = t.text.strip_prefix("set ").and_then(|r| r.split_once('='))
                && let name = name.trim()
                && is_name(name)
                && access(expr) == Some((lists[i].as_str(), None))
                && !lists.iter().any(|l| l == name)
            {
                lists.push(name.to_owned());
            }
        }
        i += 1;
    }
    let loops: Vec<(&str, &str, Option<&str>)> = tags
        .iter()
        .filter_map(|t| {
            let (target, iter) = t.text.strip_prefix("for ")?.split_once(" in ")?;
            Some((target.trim(), loop_iter(iter), t.in_macro.as_deref()))
        })
        .collect();
    let messages: Vec<&str> = loops
        .iter()
        .filter(|(target, iter, _)| {
            is_name(target)
                && access(iter)
                    .is_some_and(|(v, key)| key.is_none() && lists.iter().any(|l| l == v))
        })
        .map(|(target, _, _)| *target)
        .collect();
    let of_message = |expr: &str| {
        access(expr).is_some_and(|(v, key)| key == Some("content") && messages.contains(&v))
    };
    loops.iter().any(|(_, iter, in_macro)| {
        of_message(iter)
            || match in_macro {
                None => iter.trim() == "content",
                Some(m) => {
                    is_name(iter.trim())
                        && macro_param_takes(source, &tags, m, iter.trim(), &of_message)
                }
            }
    })
}

/// Whether a loop runs over `v.content` (or `v['content']`, sliced or
/// filtered) for a variable `v` named one of `names`: SGLang's reading.
pub fn loops_over_content_of(source: &str, names: &[&str]) -> bool {
    statements(source).iter().any(|t| {
        t.text
            .strip_prefix("for ")
            .and_then(|r| r.split_once(" in "))
            .is_some_and(|(_, iter)| {
                access(loop_iter(iter))
                    .is_some_and(|(v, key)| key == Some("content") && names.contains(&v))
            })
    })
}

/// One `{% ... %}` tag's statement, whitespace control and runs of spaces
/// removed, and the macro it stands in.
struct Statement {
    text: String,
    in_macro: Option<String>,
}

fn statements(source: &str) -> Vec<Statement> {
    let mut out = Vec::new();
    let mut in_macro: Option<String> = None;
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let Some(end) = rest[start..].find("%}") else {
            break;
        };
        let inner = rest[start + 2..start + end]
            .trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        let text = inner.split_whitespace().collect::<Vec<_>>().join(" ");
        rest = &rest[start + end + 2..];
        if let Some(def) = text.strip_prefix("macro ") {
            in_macro = Some(def.split('(').next().unwrap_or("").trim().to_owned());
        } else if text == "endmacro" {
            in_macro = None;
        }
        out.push(Statement {
            text,
            in_macro: in_macro.clone(),
        });
    }
    out
}

/// A `for` statement's iterable, without its loop filter and `recursive`.
fn loop_iter(iter: &str) -> &str {
    let iter = iter.trim();
    let iter = iter.strip_suffix(" recursive").unwrap_or(iter);
    match top_level(iter, " if ") {
        Some(at) => iter[..at].trim(),
        None => iter,
    }
}

fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars().all(|c| c == '_' || c.is_ascii_alphanumeric())
        && !s.starts_with(|c: char| c.is_ascii_digit())
}

/// The first position of `needle` outside brackets and quotes.
fn top_level(s: &str, needle: &str) -> Option<usize> {
    let (mut depth, mut quote) = (0i32, None);
    for (i, c) in s.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"') => quote = Some(c),
            (None, '(' | '[' | '{') => depth += 1,
            (None, ')' | ']' | '}') => depth -= 1,
            (None, _) if depth == 0 && s[i..].starts_with(needle) => return Some(i),
            _ => {}
        }
    }
    None
}

/// What `expr` reads, as vLLM matches it: a name, or a name's `key`
/// (`v.key`, `v['key']`), through filters, tests and slices.
fn access(expr: &str) -> Option<(&str, Option<&str>)> {
    let mut e = expr.trim();
    loop {
        let before = e;
        if let Some(at) = top_level(e, "|") {
            e = e[..at].trim();
        }
        if let Some(at) = top_level(e, " is ") {
            e = e[..at].trim();
        }
        if e.starts_with('(') && e.ends_with(')') {
            e = e[1..e.len() - 1].trim();
        }
        // A trailing slice: `[a:b]` with a colon at its top level.
        if e.ends_with(']')
            && let Some(open) = e.rfind('[')
            && top_level(&e[open + 1..e.len() - 1], ":").is_some()
        {
            e = e[..open].trim();
        }
        if e == before {
            break;
        }
    }
    if is_name(e) {
        return Some((e, None));
    }
    if let Some((v, key)) = e.split_once('.')
        && is_name(v)
        && is_name(key)
    {
        return Some((v, Some(key)));
    }
    let (v, index) = e.strip_suffix(']')?.split_once('[')?;
    let key = index
        .strip_prefix('\'')
        .and_then(|k| k.strip_suffix('\''))
        .or_else(|| index.strip_prefix('"').and_then(|k| k.strip_suffix('"')))?;
    (is_name(v) && is_name(key)).then_some((v, Some(key)))
}

/// Whether macro `name`'s parameter `param` is given a message's content
/// by some call of the macro (by position or by keyword).
fn macro_param_takes(
    source: &str,
    tags: &[Statement],
    name: &str,
    param: &str,
    of_message: &dyn Fn(&str) -> bool,
) -> bool {
    let Some(params) = tags.iter().find_map(|t| {
        let def = t.text.strip_prefix("macro ")?;
        let (n, args) = def.split_once('(')?;
        (n.trim() == name).then(|| {
            args.trim_end_matches(')')
                .split(',')
                .map(|a| a.split('=').next().unwrap_or("").trim().to_owned())
                .collect::<Vec<_>>()
        })
    }) else {
        return false;
    };
    let Some(position) = params.iter().position(|p| p == param) else {
        return false;
    };
    let call = format!("{name}(");
    let mut rest = source;
    while let Some(at) = rest.find(&call) {
        let args = &rest[at + call.len()..];
        rest = args;
        let Some(close) = top_level(args, ")") else {
            continue;
        };
        let mut args = &args[..close];
        let mut index = 0;
        loop {
            let (arg, more) = match top_level(args, ",") {
                Some(c) => (&args[..c], Some(&args[c + 1..])),
                None => (args, None),
            };
            let taken = match arg.split_once('=') {
                Some((k, v)) if is_name(k.trim()) && !v.starts_with('=') => {
                    k.trim() == param && of_message(v)
                }
                _ => index == position && of_message(arg),
            };
            if taken {
                return true;
            }
            index += 1;
            match more {
                Some(m) => args = m,
                None => break,
            }
        }
    }
    false
}

/// transformers' `{% generation %}` ... `{% endgeneration %}` marks the
/// assistant's part for training masks and renders its body unchanged:
/// the tags are dropped (with their whitespace control).
fn without_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let Some(len) = rest[start..].find("%}").map(|e| e + 2) else {
            break;
        };
        let tag = &rest[start..start + len];
        let word = tag
            .trim_start_matches("{%")
            .trim_end_matches("%}")
            .trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        out.push_str(&rest[..start]);
        if word != "generation" && word != "endgeneration" {
            out.push_str(tag);
        }
        rest = &rest[start + len..];
    }
    out.push_str(rest);
    out
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators is a pair",
            ));
        }
        // Python's defaults: ", " without an indent, "," with one.
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let json: serde_json::Value = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    let style = Style {
        indent,
        item: &item,
        key: &key,
        sort_keys: sort_keys.unwrap_or(false),
        ascii: ensure_ascii.unwrap_or(false),
    };
    write_json(&mut out, &json, &style, 0);
    Ok(Value::from_safe_string(out))
}

struct Style<'a> {
    indent: Option<usize>,
    item: &'a str,
    key: &'a str,
    sort_keys: bool,
    ascii: bool,
}

fn newline(out: &mut String, style: &Style<'_>, depth: usize) {
    if let Some(n) = style.indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', n * depth));
    }
}

fn write_json(out: &mut String, v: &serde_json::Value, style: &Style<'_>, depth: usize) {
    use serde_json::Value as J;
    match v {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Number(n) => out.push_str(&python_number(n)),
        J::String(s) => write_string(out, s, style.ascii),
        J::Array(items) if items.is_empty() => out.push_str("[]"),
        J::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(style.item);
                }
                newline(out, style, depth + 1);
                write_json(out, item, style, depth + 1);
            }
            newline(out, style, depth);
            out.push(']');
        }
        J::Object(map) if map.is_empty() => out.push_str("{}"),
        J::Object(map) => {
            let mut entries: Vec<(&String, &serde_json::Value)> = map.iter().collect();
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(style.item);
                }
                newline(out, style, depth + 1);
                write_string(out, k, style.ascii);
                out.push_str(style.key);
                write_json(out, item, style, depth + 1);
            }
            newline(out, style, depth);
            out.push('}');
        }
    }
}

/// A number as Python prints it: integers plain, floats with a decimal
/// point or an exponent (`1.0`, `1e-07`).
fn python_number(n: &serde_json::Number) -> String {
    if n.is_i64() || n.is_u64() {
        return n.to_string();
    }
    let f = n.as_f64().unwrap_or(f64::NAN);
    if f.is_finite() && f == f.trunc() && f.abs() < 1e16 {
        format!("{f:.1}")
    } else {
        let s = format!("{f:?}");
        // Rust writes `1e-7`, Python `1e-07`.
        match s.split_once('e') {
            Some((m, e)) => {
                let (sign, digits) = match e.strip_prefix('-') {
                    Some(d) => ("-", d),
                    None => ("+", e),
                };
                format!("{m}e{sign}{digits:0>2}")
            }
            None => s,
        }
    }
}

/// A JSON string as Python's `json.dumps` writes it.
fn write_string(out: &mut String, s: &str, ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ascii && !c.is_ascii()) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `repr()` of a list or a dict, as Python prints one; `None` for any
/// other value (printed as minijinja prints it).
fn python_repr(value: &Value) -> Option<String> {
    use minijinja::value::ValueKind;
    if !matches!(value.kind(), ValueKind::Seq | ValueKind::Map) {
        return None;
    }
    let json = serde_json::to_value(value).ok()?;
    let mut out = String::new();
    write_repr(&mut out, &json);
    Some(out)
}

fn write_repr(out: &mut String, v: &serde_json::Value) {
    use serde_json::Value as J;
    match v {
        J::Null => out.push_str("None"),
        J::Bool(b) => out.push_str(if *b { "True" } else { "False" }),
        J::Number(n) => out.push_str(&python_number(n)),
        J::String(s) => write_str_repr(out, s),
        J::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, item);
            }
            out.push(']');
        }
        J::Object(map) => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_str_repr(out, k);
                out.push_str(": ");
                write_repr(out, item);
            }
            out.push('}');
        }
    }
}

/// Python's `repr()` of a string: single quotes unless the text has one
/// and no double quote, and escapes for what Python does not print.
fn write_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !python_printable(c) => {
                let n = c as u32;
                if n < 0x100 {
                    out.push_str(&format!("\\x{n:02x}"));
                } else if n < 0x10000 {
                    out.push_str(&format!("\\u{n:04x}"));
                } else {
                    out.push_str(&format!("\\U{n:08x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `str.isprintable()` for one character: not a control or
/// format character, and no separator but the space.
fn python_printable(c: char) -> bool {
    !(c.is_control()
        || matches!(c as u32,
            0xa0 | 0xad | 0x1680 | 0x2000..=0x200f | 0x2028..=0x202f | 0x205f..=0x2064
            | 0x2066..=0x206f | 0x3000 | 0xfeff | 0xfff9..=0xfffb | 0xe000..=0xf8ff
            | 0xd800..=0xdfff))
}

/// Seconds since the epoch, UTC, split into a civil date and time.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Civil {
    year: i64,
    month: u32,
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    weekday: u32,
    yday: u32,
}

fn now_utc() -> Civil {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    civil(secs)
}

/// The UTC civil time of `secs` since the epoch (Howard Hinnant's days
/// from civil, inverted).
fn civil(secs: i64) -> Civil {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const BEFORE: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = BEFORE[month as usize - 1] + day + u32::from(leap && month > 2);
    Civil {
        year,
        month,
        day,
        hour: (rem / 3600) as u32,
        minute: (rem / 60 % 60) as u32,
        second: (rem % 60) as u32,
        // 1970-01-01 was a Thursday; 0 is Monday here.
        weekday: (days + 3).rem_euclid(7) as u32,
        yday,
    }
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Python's `strftime` for the directives chat templates use (the C
/// locale); any other is an error naming it.
fn strftime(format: &str, t: Civil) -> Result<String, Error> {
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{:02}", t.day)),
            Some('m') => out.push_str(&format!("{:02}", t.month)),
            Some('Y') => out.push_str(&t.year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", t.year.rem_euclid(100))),
            Some('b') => out.push_str(&MONTHS[t.month as usize - 1][..3]),
            Some('B') => out.push_str(MONTHS[t.month as usize - 1]),
            Some('a') => out.push_str(&DAYS[t.weekday as usize][..3]),
            Some('A') => out.push_str(DAYS[t.weekday as usize]),
            Some('H') => out.push_str(&format!("{:02}", t.hour)),
            Some('I') => out.push_str(&format!("{:02}", (t.hour + 11) % 12 + 1)),
            Some('p') => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{:02}", t.minute)),
            Some('S') => out.push_str(&format!("{:02}", t.second)),
            Some('j') => out.push_str(&format!("{:03}", t.yday)),
            Some('%') => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: %{} is not supported",
                        other.map_or(String::new(), String::from)
                    ),
                ));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_and_dicts_print_as_python_prints_them() {
        let env = environment("{{ v }}|{{ v | string }}|{{ v.a }}".into()).unwrap();
        let v =
            serde_json::json!({"a": "it's", "b": [1, 2.5, null, true, "q\"'\n\u{a0}"], "c": {}});
        let out = env
            .get_template("chat")
            .unwrap()
            .render(minijinja::context! { v => v })
            .unwrap();
        let repr = r#"{'a': "it's", 'b': [1, 2.5, None, True, 'q"\'\n\xa0'], 'c': {}}"#;
        assert_eq!(out, format!("{repr}|{repr}|it's"));
    }

    #[test]
    fn constructs_kvedge_cannot_render_are_named_once() {
        let source = "{{ messages[0].content | wordwrap(20) | trim }}{% if x is callable or x is sameas y %}\
            {{ '{}'.format(x) }}{{ 'a'.zfill(3) }}{{ 'a | nofilter'.strip() }}{% endif %}{{ x | wordwrap }}";
        assert_eq!(
            unsupported(source),
            ["filter `wordwrap`", "test `callable`", "method `.zfill()`"]
        );
        let fine = "{%- for m in messages %}{{ m.content.strip() | tojson(indent=2) }}\
            {%- if m.tool_calls is defined and m.items() %}{{ raise_exception('no') }}{% endif %}{% endfor %}";
        assert!(unsupported(fine).is_empty(), "{:?}", unsupported(fine));
    }

    fn render(source: &str, ctx: minijinja::Value) -> String {
        environment(source.to_owned())
            .unwrap()
            .get_template("chat")
            .unwrap()
            .render(ctx)
            .unwrap()
    }

    #[test]
    fn blocks_trim_their_newline_and_strip_their_indent() {
        let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n<|user|>\n{{ m.content }}\n    {% endif %}\n{% endfor %}\n";
        let ctx = minijinja::context! { messages => vec![minijinja::context! { role => "user", content => "hi" }] };
        assert_eq!(render(src, ctx), "<|user|>\nhi\n");
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let v: serde_json::Value =
            serde_json::from_str(r#"{"a": [1, 2.5, 1e-7, "é<&>\n"], "b": {}, "c": []}"#).unwrap();
        let ctx = minijinja::context! { v => minijinja::Value::from_serialize(&v) };
        assert_eq!(
            render("{{ v | tojson }}", ctx.clone()),
            r#"{"a": [1, 2.5, 1e-07, "é<&>\n"], "b": {}, "c": []}"#
        );
        assert_eq!(
            render("{{ v.a | tojson(indent=2) }}", ctx.clone()),
            "[\n  1,\n  2.5,\n  1e-07,\n  \"é<&>\\n\"\n]"
        );
        assert_eq!(
            render(
                "{{ v | tojson(separators=(',', ':'), ensure_ascii=true) }}",
                ctx
            ),
            r#"{"a":[1,2.5,1e-07,"\u00e9<&>\n"],"b":{},"c":[]}"#
        );
    }

    #[test]
    fn strftime_formats_the_civil_date() {
        // 2024-02-29 13:05:09 UTC, a Thursday, day 60.
        let t = civil(1_709_211_909);
        assert_eq!(
            strftime("%d %b %Y, %A %j %H:%M:%S %I%p %y %B %a %m %%", t).unwrap(),
            "29 Feb 2024, Thursday 060 13:05:09 01PM 24 February Thu 02 %"
        );
        assert!(strftime("%Q", t).is_err());
        assert_eq!(civil(0).weekday, 3, "a Thursday");
    }

    #[test]
    fn python_methods_and_generation_tags_render() {
        let src = "{% for m in messages %}{% generation %}{{ m.content.strip() }}{% endgeneration %}{% if m.content.startswith(' x') %}!{% endif %}{% for k, v in m.items() %}{% if k == 'role' %}({{ v.upper() }}){% endif %}{% endfor %}{% endfor %}";
        let ctx = minijinja::context! { messages => vec![minijinja::context! { role => "user", content => " x " }] };
        assert_eq!(render(src, ctx), "x!(USER)");
    }
}
