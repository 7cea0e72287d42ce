//! The rule-language YAML (`policy: { rules: [...] }`, `providers`,
//! `classifiers`, `ttft`) and its compilation. Everything is validated here,
//! at load: each error names the rule, the field and the YAML line.

use serde::Deserialize;
use serde_yaml::{Mapping, Value};

use super::model::{CandidateAttr, RequestAttr};
use super::predicate::{Constant, Op, parse_duration};
use super::{
    CompiledPredicate, CompiledRule, Consider, Exclude, LengthClassifier, Objective, OnEmpty,
    ProviderSpec, RulePolicy, TieBreak, Tier, TierType,
};
use crate::predict::TtftPredictor;
use crate::registry::RouterPlugins;

/// A rule policy that cannot be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{}: {message}", location(.rule, .field), at(*.line))]
pub struct RuleConfigError {
    /// The rule's name (or `#index` when it has none), if the error is in one.
    pub rule: Option<String>,
    pub field: Option<String>,
    pub line: Option<usize>,
    pub message: String,
}

fn location(rule: &Option<String>, field: &Option<String>) -> String {
    match (rule, field) {
        (Some(r), Some(f)) => format!("rule `{r}`, {f}"),
        (Some(r), None) => format!("rule `{r}`"),
        (None, Some(f)) => f.clone(),
        (None, None) => "policy".to_owned(),
    }
}

fn at(line: Option<usize>) -> String {
    line.map(|l| format!(" (line {l})")).unwrap_or_default()
}

#[derive(Deserialize)]
struct Document {
    #[serde(default)]
    policy: Option<PolicySpec>,
    #[serde(default)]
    providers: Vec<ProviderYaml>,
    #[serde(default)]
    classifiers: Option<ClassifiersYaml>,
    #[serde(default)]
    ttft: Option<TtftYaml>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicySpec {
    #[serde(default)]
    rules: Vec<RuleSpec>,
    /// Seed of the tie-break RNG.
    #[serde(default)]
    seed: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleSpec {
    name: Option<String>,
    matches: Option<Vec<Mapping>>,
    route: RouteSpec,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteSpec {
    consider: Option<Vec<ConsiderSpec>>,
    #[serde(default)]
    exclude: Vec<ExcludeSpec>,
    select: Option<Vec<TierSpec>>,
    #[serde(rename = "tieBreak")]
    tie_break: Option<TieBreak>,
    #[serde(rename = "onEmpty")]
    on_empty: Option<OnEmpty>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ConsiderSpec {
    models: Option<NamesSpec>,
    backends: Option<BackendsSpec>,
    providers: Option<NamesSpec>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct NamesSpec {
    #[serde(default)]
    names: Vec<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct BackendsSpec {
    #[serde(default)]
    names: Vec<String>,
    #[serde(default)]
    labels: std::collections::BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExcludeSpec {
    #[serde(rename = "if")]
    if_: Option<Mapping>,
    drop: Option<Mapping>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TierSpec {
    #[serde(rename = "type", default)]
    kind: TierType,
    minimize: Option<Value>,
    order: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProviderYaml {
    name: String,
    models: Vec<String>,
    endpoint: String,
    #[serde(default)]
    labels: std::collections::BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClassifiersYaml {
    length: Option<LengthYaml>,
    regex: Option<RegexYaml>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RegexYaml {
    /// Texts longer than this are not scanned (their tags are `-unknown`).
    #[serde(default = "default_text_budget")]
    max_text_bytes: usize,
    /// Tag `NAME-unknown` for a text that was not scanned (default: no tag).
    #[serde(default)]
    unknown_when_skipped: bool,
    patterns: std::collections::BTreeMap<String, String>,
}

fn default_text_budget() -> usize {
    64 * 1024
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LengthYaml {
    /// Prompts shorter than this many tokens are `complexity-low`.
    low: u32,
    /// Prompts of at least this many tokens are `complexity-high`.
    high: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TtftYaml {
    prefill_tokens_per_second: Option<f64>,
    queue_wait_per_request: Option<String>,
    host_hit_cost: Option<f64>,
    disk_hit_cost: Option<f64>,
    decode_per_block_step: Option<String>,
    step_tokens: Option<f64>,
}

/// Loads and compiles a rule policy from a YAML document. Rules that rank by
/// a worker-selection instance (`minimize: { policy: NAME }`) need
/// [`load_with`].
pub fn load(source: &str) -> Result<RulePolicy, RuleConfigError> {
    load_with(source, None)
}

/// As [`load`], resolving `minimize: { policy: NAME }` against the
/// resolved `worker_selection` configuration.
pub fn load_with(
    source: &str,
    plugins: Option<&RouterPlugins>,
) -> Result<RulePolicy, RuleConfigError> {
    let doc: Document = serde_yaml::from_str(source).map_err(|e| RuleConfigError {
        rule: None,
        field: None,
        line: e.location().map(|l| l.line()),
        message: e.to_string(),
    })?;
    let lines = RuleLines::scan(source);
    let spec = doc.policy.unwrap_or(PolicySpec {
        rules: Vec::new(),
        seed: 0,
    });
    let mut rules = Vec::with_capacity(spec.rules.len());
    let count = spec.rules.len();
    let mut cost_policies = Vec::new();
    for (index, rule) in spec.rules.into_iter().enumerate() {
        rules.push(compile_rule(
            index,
            count,
            rule,
            &lines,
            plugins,
            &mut cost_policies,
        )?);
    }
    let mut names = std::collections::BTreeSet::new();
    for (i, r) in rules.iter().enumerate() {
        if !names.insert(r.name.clone()) {
            return Err(RuleConfigError {
                rule: Some(r.name.clone()),
                field: Some("name".into()),
                line: lines.rule(i),
                message: "another rule has the same name".into(),
            });
        }
    }
    let mut providers: Vec<ProviderSpec> = Vec::new();
    let provider_err = |name: &str, message: &str| RuleConfigError {
        rule: None,
        field: Some(format!("providers.{name}")),
        line: provider_line(source, name),
        message: message.into(),
    };
    for p in doc.providers {
        if p.name.trim().is_empty() {
            return Err(RuleConfigError {
                rule: None,
                field: Some("providers".into()),
                line: crate::yaml::key_line(source, &["providers"]),
                message: "a provider needs a non-empty name".into(),
            });
        }
        if providers.iter().any(|q| q.name == p.name) {
            return Err(provider_err(
                &p.name,
                "another provider has the same name (rules could not tell them apart)",
            ));
        }
        if p.models.is_empty() {
            return Err(provider_err(
                &p.name,
                "a provider must serve at least one model",
            ));
        }
        providers.push(ProviderSpec {
            labels: p.labels.iter().map(|(k, v)| format!("{k}={v}")).collect(),
            name: p.name,
            models: p.models,
            endpoint: p.endpoint,
        });
    }
    // A Provider tier's `order` names providers: each must exist.
    for (i, r) in rules.iter().enumerate() {
        for t in &r.tiers {
            if let (TierType::Provider, Objective::Order(names)) = (t.kind, &t.objective)
                && let Some(missing) = names
                    .iter()
                    .find(|n| !providers.iter().any(|p| &p.name == *n))
            {
                return Err(RuleConfigError {
                    rule: Some(r.name.clone()),
                    field: Some("route.select.order".into()),
                    line: lines.field(i, "order").or(lines.rule(i)),
                    message: format!("`{missing}` is not a provider in `providers:`"),
                });
            }
        }
    }
    let section_line = |path: &[&str]| crate::yaml::key_line(source, path);
    let (length, regex) = match doc.classifiers {
        Some(c) => (c.length, c.regex),
        None => (None, None),
    };
    let regex = match regex {
        None => None,
        Some(r) => {
            let mut patterns = Vec::with_capacity(r.patterns.len());
            for (name, pattern) in r.patterns {
                let valid_name = !name.is_empty()
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
                if !valid_name {
                    return Err(RuleConfigError {
                        rule: None,
                        field: Some(format!("classifiers.regex.patterns.{name}")),
                        line: section_line(&["classifiers", "regex", "patterns"]),
                        message: "a tag type is lowercase letters, digits and `_`".into(),
                    });
                }
                let re = regex::Regex::new(&pattern).map_err(|e| RuleConfigError {
                    rule: None,
                    field: Some(format!("classifiers.regex.patterns.{name}")),
                    line: section_line(&["classifiers", "regex", "patterns", &name])
                        .or_else(|| section_line(&["classifiers", "regex", "patterns"])),
                    message: e.to_string(),
                })?;
                patterns.push((name, re));
            }
            Some(std::sync::Arc::new(super::RegexClassifier::new(
                r.max_text_bytes,
                r.unknown_when_skipped,
                patterns,
            )))
        }
    };
    let length = match length {
        Some(l) if l.low > l.high => {
            return Err(RuleConfigError {
                rule: None,
                field: Some("classifiers.length".into()),
                line: section_line(&["classifiers", "length"]),
                message: format!("low ({}) must not exceed high ({})", l.low, l.high),
            });
        }
        Some(l) => Some(LengthClassifier {
            low: l.low,
            high: l.high,
        }),
        None => None,
    };
    let ttft = compile_ttft(source, doc.ttft)?;
    let cost_policies_empty = cost_policies.is_empty();
    Ok(RulePolicy {
        rules,
        providers,
        length,
        regex,
        cost_policies,
        plugins: plugins.filter(|_| !cost_policies_empty).cloned(),
        ttft,
        seed: spec.seed,
    })
}

fn compile_rule(
    index: usize,
    count: usize,
    spec: RuleSpec,
    lines: &RuleLines,
    plugins: Option<&RouterPlugins>,
    cost_policies: &mut Vec<String>,
) -> Result<CompiledRule, RuleConfigError> {
    let name = spec.name.clone().unwrap_or_else(|| format!("#{index}"));
    let err = |field: &str, message: String| RuleConfigError {
        rule: Some(name.clone()),
        field: Some(field.to_owned()),
        line: lines
            .field(
                index,
                field
                    .rsplit('.')
                    .next()
                    .and_then(|f| f.split('[').next())
                    .unwrap_or(field),
            )
            .or(lines.rule(index)),
        message,
    };
    let matches = match spec.matches {
        None => {
            if index + 1 != count {
                return Err(err(
                    "matches",
                    "a rule without `matches` matches every request, so it must be the last rule"
                        .into(),
                ));
            }
            None
        }
        Some(entries) => {
            if entries.is_empty() {
                return Err(err(
                    "matches",
                    "an empty list matches nothing; omit `matches` to match every request".into(),
                ));
            }
            let mut out = Vec::with_capacity(entries.len());
            for entry in &entries {
                out.push(request_predicates(entry).map_err(|m| err("matches", m))?);
            }
            Some(out)
        }
    };
    let route = spec.route;
    let consider = match route.consider {
        None => None,
        Some(list) if list.is_empty() => {
            return Err(err("route.consider", "an empty list is not allowed; omit `consider` to consider every local endpoint of the request's model".into()));
        }
        Some(list) => {
            let mut out = Vec::with_capacity(list.len());
            for c in list {
                let set = [
                    c.models.is_some(),
                    c.backends.is_some(),
                    c.providers.is_some(),
                ]
                .iter()
                .filter(|x| **x)
                .count();
                if set != 1 {
                    return Err(err(
                        "route.consider",
                        "each entry takes exactly one of `models`, `backends`, `providers`".into(),
                    ));
                }
                out.push(if let Some(m) = c.models {
                    if m.names.is_empty() {
                        return Err(err(
                            "route.consider",
                            "`models` needs at least one name".into(),
                        ));
                    }
                    Consider::Models(m.names)
                } else if let Some(b) = c.backends {
                    Consider::Backends {
                        names: b.names,
                        labels: b.labels.iter().map(|(k, v)| format!("{k}={v}")).collect(),
                    }
                } else {
                    Consider::Providers(c.providers.unwrap_or_default().names)
                });
            }
            Some(out)
        }
    };
    let mut exclude = Vec::with_capacity(route.exclude.len());
    for e in &route.exclude {
        let Some(drop) = &e.drop else {
            return Err(err(
                "route.exclude",
                "each entry needs `drop` (the candidates to remove)".into(),
            ));
        };
        let when = match &e.if_ {
            Some(m) => request_predicates(m).map_err(|m| err("route.exclude.if", m))?,
            None => Vec::new(),
        };
        let drop = candidate_predicates(drop).map_err(|m| err("route.exclude.drop", m))?;
        exclude.push(Exclude { when, drop });
    }
    let Some(select) = route.select else {
        return Err(err(
            "route.select",
            "every rule needs `select` (at least one tier)".into(),
        ));
    };
    if select.is_empty() {
        return Err(err(
            "route.select",
            "`select` needs at least one tier".into(),
        ));
    }
    let mut tiers = Vec::with_capacity(select.len());
    for (t, tier) in select.into_iter().enumerate() {
        let field = format!("route.select[{t}]");
        if tier.minimize.is_some() && tier.order.is_some() {
            return Err(err(
                &field,
                "a tier takes `minimize` or `order`, not both".into(),
            ));
        }
        let objective = match (tier.minimize, tier.order) {
            (Some(Value::Mapping(m)), _) => {
                let name = match (m.len(), m.get("policy").and_then(Value::as_str)) {
                    (1, Some(name)) => name.to_owned(),
                    _ => {
                        return Err(err(
                            &field,
                            "`minimize` takes an objective name or `{ policy: NAME }`".into(),
                        ));
                    }
                };
                let Some(plugins) = plugins else {
                    return Err(err(
                        &field,
                        format!(
                            "`minimize: {{ policy: {name} }}` needs the worker_selection configuration (load the rules together with it)"
                        ),
                    ));
                };
                if !plugins.has_instance(&name) {
                    return Err(err(
                        &field,
                        format!(
                            "`{name}` is neither `default` nor a configured worker_selection instance"
                        ),
                    ));
                }
                if tier.kind != TierType::Local {
                    return Err(err(
                        &field,
                        format!(
                            "the cost of worker-selection instance `{name}` is defined only for Local candidates, so a `{}` tier cannot minimize it",
                            tier.kind.name()
                        ),
                    ));
                }
                let slot = match cost_policies.iter().position(|n| *n == name) {
                    Some(slot) => slot,
                    None => {
                        cost_policies.push(name);
                        cost_policies.len() - 1
                    }
                };
                Objective::PolicyCost(slot)
            }
            (Some(v), _) => {
                let o = objective(&v).map_err(|m| err(&field, m))?;
                if tier.kind != TierType::Local {
                    return Err(err(
                        &field,
                        format!(
                            "objective `{}` is defined only for Local candidates, so a `{}` tier cannot minimize it",
                            o.name(),
                            tier.kind.name()
                        ),
                    ));
                }
                Objective::Minimize(o)
            }
            (None, Some(order)) => {
                if order.is_empty() {
                    return Err(err(&field, "`order` needs at least one name".into()));
                }
                Objective::Order(order)
            }
            (None, None) => Objective::RankOrder,
        };
        tiers.push(Tier {
            kind: tier.kind,
            objective,
        });
    }
    Ok(CompiledRule {
        name,
        matches,
        consider,
        exclude,
        tiers,
        tie_break: route.tie_break,
        on_empty: route.on_empty.unwrap_or(OnEmpty::Reject),
    })
}

fn objective(v: &Value) -> Result<CandidateAttr, String> {
    let Some(name) = v.as_str() else {
        return Err(
            "`minimize` takes an objective name (PredictedTTFT, kvUsage, activeRequests, waitingRequests) or `{ policy: NAME }`"
                .into(),
        );
    };
    match CandidateAttr::parse(name) {
        Some(
            a @ (CandidateAttr::PredictedTtft
            | CandidateAttr::KvUsage
            | CandidateAttr::ActiveRequests
            | CandidateAttr::WaitingRequests),
        ) => Ok(a),
        _ => Err(format!(
            "unknown objective `{name}` (known: PredictedTTFT, kvUsage, activeRequests, waitingRequests)"
        )),
    }
}

fn request_predicates(m: &Mapping) -> Result<Vec<CompiledPredicate<RequestAttr>>, String> {
    predicates(m, |name| {
        RequestAttr::parse(name).ok_or_else(|| {
            format!(
                "unknown request attribute `{name}` (known: {})",
                RequestAttr::NAMES
            )
        })
    })
}

fn candidate_predicates(m: &Mapping) -> Result<Vec<CompiledPredicate<CandidateAttr>>, String> {
    predicates(m, |name| {
        CandidateAttr::parse(name).ok_or_else(|| {
            format!(
                "unknown candidate attribute `{name}` (known: {})",
                CandidateAttr::NAMES
            )
        })
    })
}

fn predicates<A>(
    m: &Mapping,
    attr: impl Fn(&str) -> Result<A, String>,
) -> Result<Vec<CompiledPredicate<A>>, String> {
    if m.is_empty() {
        return Err("an empty predicate set is not allowed".into());
    }
    let mut out = Vec::with_capacity(m.len());
    for (k, v) in m {
        let name = k.as_str().ok_or("attribute names are strings")?;
        let attr = attr(name)?;
        let op = operator(name, v)?;
        out.push(CompiledPredicate { attr, op });
    }
    Ok(out)
}

fn constant(name: &str, v: &Value) -> Result<Constant, String> {
    match v {
        Value::String(s) => Ok(match parse_duration(s) {
            // A duration constant is compared as seconds.
            Some(secs)
                if s.chars().any(|c| c.is_ascii_alphabetic())
                    && s.starts_with(|c: char| c.is_ascii_digit()) =>
            {
                Constant::Num(secs)
            }
            _ => Constant::Str(s.clone()),
        }),
        Value::Number(n) => n
            .as_f64()
            .map(Constant::Num)
            .ok_or_else(|| format!("`{name}`: number out of range")),
        Value::Bool(b) => Ok(Constant::Str(b.to_string())),
        _ => Err(format!("`{name}`: expected a string, number or duration")),
    }
}

fn number(name: &str, op: &str, v: &Value) -> Result<f64, String> {
    match constant(name, v)? {
        Constant::Num(n) => Ok(n),
        Constant::Str(s) => Err(format!(
            "`{name}`: `{op}` needs a number or duration, got `{s}`"
        )),
    }
}

fn list(name: &str, v: &Value) -> Result<Vec<Constant>, String> {
    match v {
        Value::Sequence(items) => items.iter().map(|i| constant(name, i)).collect(),
        other => Ok(vec![constant(name, other)?]),
    }
}

fn operator(name: &str, v: &Value) -> Result<Op, String> {
    match v {
        Value::Mapping(m) => {
            if m.len() != 1 {
                return Err(format!(
                    "`{name}`: an operator map takes exactly one key, got {}",
                    m.len()
                ));
            }
            let (k, arg) = m.iter().next().expect("one entry");
            let op = k.as_str().unwrap_or("");
            Ok(match op {
                "equal" => Op::Equal(constant(name, arg)?),
                "notEqual" => Op::NotEqual(constant(name, arg)?),
                "greaterThan" => Op::GreaterThan(number(name, op, arg)?),
                "lessThan" => Op::LessThan(number(name, op, arg)?),
                "greaterOrEqual" => Op::GreaterOrEqual(number(name, op, arg)?),
                "lessOrEqual" => Op::LessOrEqual(number(name, op, arg)?),
                "in" => Op::In(list(name, arg)?),
                "notIn" => Op::NotIn(list(name, arg)?),
                "exists" => Op::Exists(
                    arg.as_bool()
                        .ok_or_else(|| format!("`{name}`: `exists` takes true or false"))?,
                ),
                other => {
                    return Err(format!(
                        "`{name}`: unknown operator `{other}` (known: equal, notEqual, greaterThan, lessThan, greaterOrEqual, lessOrEqual, in, notIn, exists)"
                    ));
                }
            })
        }
        Value::Sequence(_) => Ok(Op::In(list(name, v)?)),
        _ => Ok(Op::Equal(constant(name, v)?)),
    }
}

/// The line of provider `name`'s entry (its `name:` key) under
/// `providers:`, in a block-style document.
fn provider_line(source: &str, name: &str) -> Option<usize> {
    let start = crate::yaml::key_line(source, &["providers"])?;
    source
        .lines()
        .enumerate()
        .skip(start)
        .find(|(_, l)| {
            let t = l.trim_start().trim_start_matches('-').trim_start();
            t.strip_prefix("name:")
                .is_some_and(|v| v.trim().trim_matches(|c| c == '"' || c == '\'') == name)
        })
        .map(|(n, _)| n + 1)
        .or(Some(start))
}

/// Lines of rule items and their fields in a block-style document.
#[derive(Debug, Default)]
struct RuleLines {
    /// (start line, end line exclusive) of each rule item.
    rules: Vec<(usize, usize)>,
    text: Vec<String>,
}

impl RuleLines {
    fn scan(source: &str) -> RuleLines {
        let text: Vec<String> = source.lines().map(str::to_owned).collect();
        let mut rules = Vec::new();
        let mut rules_indent: Option<usize> = None;
        let mut item_indent: Option<usize> = None;
        for (i, raw) in text.iter().enumerate() {
            let trimmed = raw.trim_start();
            if trimmed.is_empty() || trimmed.starts_with('#') {
                continue;
            }
            let indent = raw.len() - trimmed.len();
            if let Some(base) = rules_indent {
                let is_item = trimmed.starts_with('-');
                if indent > base || (indent == base && is_item) {
                    if is_item && item_indent.is_none_or(|ii| ii == indent) {
                        item_indent = Some(indent);
                        if let Some(last) = rules.last_mut() {
                            let (_, end): &mut (usize, usize) = last;
                            *end = i + 1;
                        }
                        rules.push((i + 1, text.len() + 1));
                    }
                    continue;
                }
                if let Some(last) = rules.last_mut() {
                    last.1 = i + 1;
                }
                rules_indent = None;
            }
            if trimmed.starts_with("rules:") {
                rules_indent = Some(indent);
                item_indent = None;
            }
        }
        RuleLines { rules, text }
    }

    fn rule(&self, index: usize) -> Option<usize> {
        self.rules.get(index).map(|(s, _)| *s)
    }

    /// The first line inside rule `index` whose key is `field`.
    fn field(&self, index: usize, field: &str) -> Option<usize> {
        let (start, end) = *self.rules.get(index)?;
        (start..end).find(|&line| {
            let t = self.text[line - 1]
                .trim_start()
                .trim_start_matches('-')
                .trim_start();
            t.strip_prefix(field)
                .is_some_and(|rest| rest.starts_with(':'))
        })
    }
}

/// The `ttft:` section of `source` (the predictor's defaults without one).
pub fn load_ttft(source: &str) -> Result<TtftPredictor, RuleConfigError> {
    #[derive(Deserialize)]
    struct Only {
        #[serde(default)]
        ttft: Option<TtftYaml>,
    }
    let doc: Only = serde_yaml::from_str(source).map_err(|e| RuleConfigError {
        rule: None,
        field: Some("ttft".into()),
        line: e.location().map(|l| l.line()),
        message: e.to_string(),
    })?;
    compile_ttft(source, doc.ttft)
}

fn compile_ttft(source: &str, section: Option<TtftYaml>) -> Result<TtftPredictor, RuleConfigError> {
    let mut ttft = TtftPredictor::default();
    let Some(t) = section else {
        return Ok(ttft);
    };
    let fail = |key: &str, message: String| RuleConfigError {
        rule: None,
        field: Some(format!("ttft.{key}")),
        line: crate::yaml::key_line(source, &["ttft", key]),
        message,
    };
    if let Some(w) = &t.queue_wait_per_request {
        ttft.queue_wait_per_request = parse_duration(w).ok_or_else(|| {
            fail(
                "queue_wait_per_request",
                format!("`{w}` is not a duration (e.g. 50ms, 1s, 1m30s)"),
            )
        })?;
    }
    if let Some(d) = &t.decode_per_block_step {
        ttft.decode_per_block_step = parse_duration(d).ok_or_else(|| {
            fail(
                "decode_per_block_step",
                format!("`{d}` is not a duration (e.g. 700ns, 0.7us)"),
            )
        })?;
    }
    ttft.step_tokens = t.step_tokens.unwrap_or(ttft.step_tokens);
    ttft.prefill_tokens_per_second = t
        .prefill_tokens_per_second
        .unwrap_or(ttft.prefill_tokens_per_second);
    ttft.host_hit_cost = t.host_hit_cost.unwrap_or(ttft.host_hit_cost);
    ttft.disk_hit_cost = t.disk_hit_cost.unwrap_or(ttft.disk_hit_cost);
    ttft.validate()
        .map_err(|(key, message)| fail(key, message))?;
    Ok(ttft)
}
