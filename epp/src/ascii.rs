//! The pre-tokenizers' expressions matched by hand on ASCII text. Running
//! the expression over the whole prompt (to find where a cached prefix may
//! end) was most of the plain-text cache's cost: the regular-expression
//! engine runs each match forward to find its end and backward to find its
//! start. The expressions real tokenizers ship are a handful of character
//! runs, and on ASCII text each run is a loop over a 128-entry class table.
//!
//! Known here, by their exact text: `Whitespace`'s, GPT-2's (`ByteLevel`
//! with its own expression), and the `Split` expressions of Llama 3 and of
//! Qwen 2 (the same but one digit a piece). [`Expr::pieces`] yields exactly
//! the matches the expression's engine yields, leftmost-first with its
//! backtracking, in order; text with any non-ASCII byte is left to the
//! engine (its classes are Unicode's). The tests compare both over
//! generated text.

/// One of the expressions matched here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expr {
    /// `\w+|[^\w\s]+`
    Whitespace,
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
    Gpt2,
    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,N}|
    /// ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`, N digits at most
    /// a piece (Llama 3: 3; Qwen 2: 1).
    Llama3 { digits: usize },
}

/// Llama 3's `Split` expression.
pub const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's `Split` expression.
pub const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// An ASCII byte's class: a letter (`\p{L}`), a digit (`\p{N}`), white
/// space (`\s`: tab, line feed, vertical tab, form feed, carriage return,
/// space) or anything else (punctuation, `_`, control bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Letter,
    Digit,
    Space,
    Other,
}

const CLASSES: [Class; 128] = {
    let mut t = [Class::Other; 128];
    let mut b = 0;
    while b < 128 {
        let c = b as u8;
        t[b] = if c.is_ascii_alphabetic() {
            Class::Letter
        } else if c.is_ascii_digit() {
            Class::Digit
        } else if matches!(c, b'\t' | b'\n' | 0x0B | 0x0C | b'\r' | b' ') {
            Class::Space
        } else {
            Class::Other
        };
        b += 1;
    }
    t
};

fn class(b: u8) -> Class {
    CLASSES[usize::from(b & 0x7F)]
}

/// The end of the run of bytes of class `c` from `at` (`at` itself when
/// none).
fn run(t: &[u8], mut at: usize, c: Class) -> usize {
    while at < t.len() && class(t[at]) == c {
        at += 1;
    }
    at
}

fn is_word(b: u8) -> bool {
    b == b'_' || matches!(class(b), Class::Letter | Class::Digit)
}

/// The length of the contraction (`'s`, `'t`, `'re`, `'ve`, `'m`, `'ll`,
/// `'d`) at the start of `t`, if any; letters of any case when `fold`.
fn contraction(t: &[u8], fold: bool) -> Option<usize> {
    if t.first() != Some(&b'\'') {
        return None;
    }
    let lower = |i: usize| {
        t.get(i)
            .map(|&b| if fold { b.to_ascii_lowercase() } else { b })
    };
    match (lower(1)?, lower(2)) {
        (b's' | b't' | b'm' | b'd', _) => Some(2),
        (b'r', Some(b'e')) | (b'v', Some(b'e')) | (b'l', Some(b'l')) => Some(3),
        _ => None,
    }
}

impl Expr {
    /// The expression of this text, if it is one matched here.
    pub fn of(pattern: &str) -> Option<Expr> {
        match pattern {
            LLAMA3_PATTERN => Some(Expr::Llama3 { digits: 3 }),
            QWEN2_PATTERN => Some(Expr::Llama3 { digits: 1 }),
            _ => None,
        }
    }

    /// Calls `found(start, end)` for each match in `text`, in order, as
    /// the expression's engine finds them; `false` (and nothing called)
    /// when `text` is not all ASCII.
    pub fn pieces(self, text: &str, mut found: impl FnMut(usize, usize)) -> bool {
        if !text.is_ascii() {
            return false;
        }
        let t = text.as_bytes();
        let mut at = 0;
        while at < t.len() {
            match self.next(t, at) {
                Some((s, e)) => {
                    found(s, e);
                    at = e;
                }
                None => break,
            }
        }
        true
    }

    /// The first match at or after `at`.
    fn next(self, t: &[u8], mut at: usize) -> Option<(usize, usize)> {
        while at < t.len() {
            let end = match self {
                Expr::Whitespace => whitespace(t, at),
                Expr::Gpt2 => Some(gpt2(t, at)),
                Expr::Llama3 { digits } => Some(llama3(t, at, digits)),
            };
            if let Some(end) = end {
                return Some((at, end));
            }
            at += 1;
        }
        None
    }
}

/// `\w+|[^\w\s]+` at `at`: where its match ends, if one starts there.
fn whitespace(t: &[u8], at: usize) -> Option<usize> {
    let b = t[at];
    let mut end = at;
    if is_word(b) {
        while end < t.len() && is_word(t[end]) {
            end += 1;
        }
    } else if class(b) != Class::Space {
        while end < t.len() && !is_word(t[end]) && class(t[end]) != Class::Space {
            end += 1;
        }
    }
    (end > at).then_some(end)
}

/// `\s+(?!\S)|\s+` at `at`, which is white space: the run, less its last
/// byte when something other than space follows and the run is longer
/// than one.
fn spaces(t: &[u8], at: usize) -> usize {
    let end = run(t, at, Class::Space);
    if end < t.len() && end - at > 1 {
        end - 1
    } else {
        end
    }
}

/// GPT-2's expression at `at` (every ASCII byte starts a match): where
/// its match ends.
fn gpt2(t: &[u8], at: usize) -> usize {
    if let Some(n) = contraction(&t[at..], false) {
        return at + n;
    }
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional space,
    // then a run of one class.
    let from = if t[at] == b' ' && at + 1 < t.len() {
        at + 1
    } else {
        at
    };
    match class(t[from]) {
        Class::Space => spaces(t, at),
        c => run(t, from, c),
    }
}

/// Llama 3's expression at `at` (every ASCII byte starts a match), with
/// at most `digits` digits a piece: where its match ends.
fn llama3(t: &[u8], at: usize, digits: usize) -> usize {
    if let Some(n) = contraction(&t[at..], true) {
        return at + n;
    }
    let first = class(t[at]);
    let next = t.get(at + 1).map(|&b| class(b));
    // `[^\r\n\p{L}\p{N}]?\p{L}+`
    if first == Class::Letter {
        return run(t, at, Class::Letter);
    }
    if next == Some(Class::Letter) && !matches!(t[at], b'\r' | b'\n') && first != Class::Digit {
        return run(t, at + 1, Class::Letter);
    }
    // `\p{N}{1,N}`
    if first == Class::Digit {
        return run(t, at, Class::Digit).min(at + digits);
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    let other = if first == Class::Other {
        Some(at)
    } else if t[at] == b' ' && next == Some(Class::Other) {
        Some(at + 1)
    } else {
        None
    };
    if let Some(from) = other {
        let mut end = run(t, from, Class::Other);
        while end < t.len() && matches!(t[end], b'\r' | b'\n') {
            end += 1;
        }
        return end;
    }
    // White space: `\s*[\r\n]+` up to the run's last line break, if it
    // has one; else `\s+(?!\S)|\s+`.
    let end = run(t, at, Class::Space);
    match t[at..end].iter().rposition(|&b| matches!(b, b'\r' | b'\n')) {
        Some(i) => at + i + 1,
        None => spaces(t, at),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::{GPT2_PATTERN, WHITESPACE_PATTERN};
    use proptest::prelude::*;

    /// The matches the expression's own engine finds (the one the
    /// tokenizer runs it with).
    fn engine(expr: Expr, text: &str) -> Vec<(usize, usize)> {
        let pattern = match expr {
            Expr::Whitespace => {
                return regex::Regex::new(WHITESPACE_PATTERN)
                    .unwrap()
                    .find_iter(text)
                    .map(|m| (m.start(), m.end()))
                    .collect();
            }
            Expr::Gpt2 => GPT2_PATTERN,
            Expr::Llama3 { digits: 3 } => LLAMA3_PATTERN,
            Expr::Llama3 { .. } => QWEN2_PATTERN,
        };
        fancy_regex::Regex::new(pattern)
            .unwrap()
            .find_iter(text)
            .map(|m| m.map(|m| (m.start(), m.end())).unwrap())
            .collect()
    }

    fn by_hand(expr: Expr, text: &str) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        assert!(expr.pieces(text, |s, e| out.push((s, e))));
        out
    }

    const EXPRS: [Expr; 4] = [
        Expr::Whitespace,
        Expr::Gpt2,
        Expr::Llama3 { digits: 3 },
        Expr::Llama3 { digits: 1 },
    ];

    #[test]
    fn the_expressions_are_known_by_their_text() {
        assert_eq!(Expr::of(LLAMA3_PATTERN), Some(Expr::Llama3 { digits: 3 }));
        assert_eq!(Expr::of(QWEN2_PATTERN), Some(Expr::Llama3 { digits: 1 }));
        assert_eq!(Expr::of(r"\s+|\S+"), None);
    }

    #[test]
    fn every_ascii_byte_is_classed_as_the_engine_classes_it() {
        let letter = regex::Regex::new(r"^\p{L}$").unwrap();
        let digit = regex::Regex::new(r"^\p{N}$").unwrap();
        let space = regex::Regex::new(r"^\s$").unwrap();
        let word = regex::Regex::new(r"^\w$").unwrap();
        for b in 0u8..128 {
            let s = (b as char).to_string();
            let want = if letter.is_match(&s) {
                Class::Letter
            } else if digit.is_match(&s) {
                Class::Digit
            } else if space.is_match(&s) {
                Class::Space
            } else {
                Class::Other
            };
            assert_eq!(class(b), want, "byte {b:#04x}");
            assert_eq!(is_word(b), word.is_match(&s), "byte {b:#04x}");
        }
    }

    #[test]
    fn the_tricky_places_split_as_the_engine_splits_them() {
        let texts = [
            "",
            " ",
            "  ",
            "a",
            "hello world",
            "  hello",
            "   \n\n  x",
            "x \n",
            "x\r\n\r\ny",
            " \t\n \tz",
            "don't I'LL we'Re 've 'x ''s",
            "'",
            "'r",
            "!'s",
            "12345 678 9",
            " 1 22 333 4444",
            "a_b __init__ (x) ((y)) .. !!\n\n?",
            " !\n\n \r\n",
            "\x00\x01\x7f \x0b\x0c x",
            "end with space ",
            "end with spaces   ",
            "tab\tthen\t\tword",
            "(hello [world]) {x}",
        ];
        for expr in EXPRS {
            for text in texts {
                assert_eq!(
                    by_hand(expr, text),
                    engine(expr, text),
                    "{expr:?} on {text:?}"
                );
            }
        }
    }

    #[test]
    fn text_with_a_non_ascii_byte_is_left_to_the_engine() {
        for expr in EXPRS {
            assert!(!expr.pieces("café", |_, _| panic!("nothing found")));
        }
    }

    /// Text made of the pieces that matter to these expressions.
    fn text() -> impl Strategy<Value = String> {
        let atoms = prop::sample::select(vec![
            "a", "Z", "s", "t", "re", "RE", "ve", "m", "LL", "ll", "d", "D", "0", "7", "42", " ",
            " ", "  ", "\t", "\n", "\r", "\r\n", "\x0b", "\x0c", "'", "'", "_", "!", ".", "(",
            "\x00", "\x7f", "word", "Word", "123456",
        ]);
        prop::collection::vec(atoms, 0..40).prop_map(|v| v.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn generated_text_splits_as_the_engine_splits_it(text in text()) {
            for expr in EXPRS {
                prop_assert_eq!(by_hand(expr, &text), engine(expr, &text), "{:?}", expr);
            }
        }

        #[test]
        fn any_ascii_bytes_split_as_the_engine_splits_them(bytes in prop::collection::vec(0u8..128, 0..64)) {
            let text = String::from_utf8(bytes).unwrap();
            for expr in EXPRS {
                prop_assert_eq!(by_hand(expr, &text), engine(expr, &text), "{:?}", expr);
            }
        }
    }
}
