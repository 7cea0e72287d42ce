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
    env.add_template_owned("chat", without_generation_tags(&source))?;
    Ok(env)
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
