//! Predicates of the rule language: `attr: value`, `attr: [a, b]` and the
//! one-key operator forms (`equal`, `notEqual`, `greaterThan`, `lessThan`,
//! `greaterOrEqual`, `lessOrEqual`, `in`, `notIn`, `exists`), over string,
//! numeric, set and duration values.
//!
//! A predicate on an attribute the subject does not have is false, negated or
//! not; only `exists: false` matches absence. Predicates are compiled once:
//! constants are parsed (durations to seconds) at load, and evaluation
//! compares without allocating.

use std::fmt;

/// A constant in a predicate.
#[derive(Clone, Debug, PartialEq)]
pub enum Constant {
    Str(String),
    /// Numbers and durations (in seconds).
    Num(f64),
}

impl fmt::Display for Constant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Constant::Str(s) => f.write_str(s),
            Constant::Num(n) => write!(f, "{n}"),
        }
    }
}

/// An attribute's value as the evaluator reads it (borrowed, never copied).
#[derive(Clone, Copy, Debug)]
pub enum AttrValue<'a> {
    Str(&'a str),
    Num(f64),
    /// A set of strings (request tags, backend labels as `key=value`).
    Set(&'a [&'a str]),
}

/// A compiled operator.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    Equal(Constant),
    NotEqual(Constant),
    GreaterThan(f64),
    LessThan(f64),
    GreaterOrEqual(f64),
    LessOrEqual(f64),
    In(Vec<Constant>),
    NotIn(Vec<Constant>),
    Exists(bool),
}

impl Op {
    /// Evaluates against a present (`Some`) or absent (`None`) value.
    #[inline]
    pub fn eval(&self, value: Option<AttrValue<'_>>) -> bool {
        let Some(v) = value else {
            return matches!(self, Op::Exists(false));
        };
        match self {
            Op::Exists(e) => *e,
            Op::Equal(c) => equals(v, c),
            Op::NotEqual(c) => !equals(v, c),
            Op::In(cs) => cs.iter().any(|c| equals(v, c)),
            Op::NotIn(cs) => !cs.iter().any(|c| equals(v, c)),
            Op::GreaterThan(x) => num(v).is_some_and(|n| n > *x),
            Op::LessThan(x) => num(v).is_some_and(|n| n < *x),
            Op::GreaterOrEqual(x) => num(v).is_some_and(|n| n >= *x),
            Op::LessOrEqual(x) => num(v).is_some_and(|n| n <= *x),
        }
    }
}

fn num(v: AttrValue<'_>) -> Option<f64> {
    match v {
        AttrValue::Num(n) => Some(n),
        _ => None,
    }
}

/// Equality; on a set, membership.
fn equals(v: AttrValue<'_>, c: &Constant) -> bool {
    match (v, c) {
        (AttrValue::Str(s), Constant::Str(k)) => s == k,
        (AttrValue::Num(n), Constant::Num(k)) => n == *k,
        (AttrValue::Set(items), Constant::Str(k)) => items.iter().any(|i| i == k),
        _ => false,
    }
}

/// Parses a duration: `5s`, `200ms`, `1m30s`, `1h`, `250us` (to seconds).
pub fn parse_duration(text: &str) -> Option<f64> {
    let mut rest = text.trim();
    if rest.is_empty() {
        return None;
    }
    let mut total = 0.0;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if digits == 0 {
            return None;
        }
        let value: f64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        total += value * scale;
        rest = &rest[unit_len..];
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("5s"), Some(5.0));
        assert_eq!(parse_duration("200ms"), Some(0.2));
        assert_eq!(parse_duration("1m30s"), Some(90.0));
        assert_eq!(parse_duration("1h"), Some(3600.0));
        assert_eq!(parse_duration("1.5s"), Some(1.5));
        for bad in ["", "5", "s", "5x", "5s3", "1m-3s"] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
    }

    #[test]
    fn absence_is_false_for_everything_but_exists_false() {
        let ops = [
            Op::Equal(Constant::Str("a".into())),
            Op::NotEqual(Constant::Str("a".into())),
            Op::GreaterThan(1.0),
            Op::LessThan(1.0),
            Op::In(vec![Constant::Str("a".into())]),
            Op::NotIn(vec![Constant::Str("a".into())]),
            Op::Exists(true),
        ];
        for op in &ops {
            assert!(!op.eval(None), "{op:?}");
        }
        assert!(Op::Exists(false).eval(None));
        assert!(!Op::Exists(false).eval(Some(AttrValue::Num(0.0))));
    }

    #[test]
    fn operators_on_values() {
        let s = Some(AttrValue::Str("alice"));
        assert!(Op::Equal(Constant::Str("alice".into())).eval(s));
        assert!(Op::NotEqual(Constant::Str("bob".into())).eval(s));
        assert!(
            Op::In(vec![
                Constant::Str("bob".into()),
                Constant::Str("alice".into())
            ])
            .eval(s)
        );
        assert!(!Op::NotIn(vec![Constant::Str("alice".into())]).eval(s));
        let n = Some(AttrValue::Num(3.0));
        assert!(Op::GreaterThan(2.0).eval(n) && !Op::GreaterThan(3.0).eval(n));
        assert!(Op::GreaterOrEqual(3.0).eval(n) && Op::LessOrEqual(3.0).eval(n));
        assert!(
            !Op::GreaterThan(2.0).eval(s),
            "a string is not greater than anything"
        );
        let tags = ["pii-confirmed", "complexity-low"];
        let set = Some(AttrValue::Set(&tags));
        assert!(Op::Equal(Constant::Str("pii-confirmed".into())).eval(set));
        assert!(
            Op::In(vec![
                Constant::Str("pii-unknown".into()),
                Constant::Str("complexity-low".into())
            ])
            .eval(set)
        );
        assert!(Op::NotIn(vec![Constant::Str("code-high".into())]).eval(set));
    }
}
