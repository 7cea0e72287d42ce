//! The `worker_selection:` YAML section: which configured instance serves
//! each role, and the instances (a name, a registered type, parameters).
//!
//! ```yaml
//! worker_selection:
//!   aggregated: least-busy
//!   prefill: prefill-least-busy
//!   instances:
//!     - name: least-busy
//!       type: least-busy
//!       parameters:
//!         min_device_overlap_blocks: 0
//! ```
//!
//! Other top-level keys belong to the host and are ignored here; inside the
//! section unknown keys are errors. Errors name the YAML line: serde reports
//! it for syntax and shape errors, and a small scan of the block-style source
//! finds the line of each role key and each instance for the checks made
//! after parsing (flow-style sections parse fine but report no line).

use serde::Deserialize;

use crate::context::WorkerType;
use crate::error::PolicyConfigError;

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Section {
    aggregated: Option<String>,
    prefill: Option<String>,
    decode: Option<String>,
    encode: Option<String>,
    #[serde(default)]
    instances: Vec<InstanceSpec>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct InstanceSpec {
    name: String,
    #[serde(rename = "type")]
    type_name: String,
    #[serde(default)]
    parameters: Option<serde_yaml::Value>,
}

#[derive(Deserialize)]
struct Document {
    #[serde(default)]
    worker_selection: Option<Section>,
}

/// One configured instance.
#[derive(Clone, Debug)]
pub struct InstanceConfig {
    pub name: String,
    pub type_name: String,
    /// The `parameters` mapping (an empty mapping when omitted).
    pub parameters: serde_yaml::Value,
    /// 1-based line of the instance's list item, when known.
    pub line: Option<usize>,
}

/// A parsed `worker_selection` section.
#[derive(Clone, Debug, Default)]
pub struct WorkerSelectionConfig {
    roles: [Option<(String, Option<usize>)>; 4],
    instances: Vec<InstanceConfig>,
}

impl WorkerSelectionConfig {
    /// No section: every role uses the built-in policy.
    pub fn empty() -> Self {
        Self::default()
    }

    /// Parses a YAML document that may contain a `worker_selection` section.
    pub fn from_yaml_str(source: &str) -> Result<Self, PolicyConfigError> {
        let doc: Document = serde_yaml::from_str(source).map_err(|e| PolicyConfigError::Yaml {
            line: e.location().map(|l| l.line()),
            message: e.to_string(),
        })?;
        let Some(section) = doc.worker_selection else {
            return Ok(Self::empty());
        };
        let lines = Lines::scan(source);
        let role_value = |v: Option<String>, t: WorkerType| v.map(|name| (name, lines.role(t)));
        let roles = [
            role_value(section.aggregated, WorkerType::Aggregated),
            role_value(section.prefill, WorkerType::Prefill),
            role_value(section.decode, WorkerType::Decode),
            role_value(section.encode, WorkerType::Encode),
        ];
        let instances = section
            .instances
            .into_iter()
            .enumerate()
            .map(|(i, spec)| InstanceConfig {
                name: spec.name,
                type_name: spec.type_name,
                parameters: match spec.parameters {
                    None | Some(serde_yaml::Value::Null) => {
                        serde_yaml::Value::Mapping(serde_yaml::Mapping::new())
                    }
                    Some(v) => v,
                },
                line: lines.instances.get(i).copied(),
            })
            .collect();
        Ok(WorkerSelectionConfig { roles, instances })
    }

    /// The selection written for `role`, with its line.
    pub fn role(&self, role: WorkerType) -> Option<(&str, Option<usize>)> {
        self.roles[role as usize]
            .as_ref()
            .map(|(name, line)| (name.as_str(), *line))
    }

    pub fn instances(&self) -> &[InstanceConfig] {
        &self.instances
    }
}

/// Line numbers of the role keys and instance items of a block-style section.
#[derive(Debug, Default)]
struct Lines {
    roles: [Option<usize>; 4],
    instances: Vec<usize>,
}

impl Lines {
    fn scan(source: &str) -> Lines {
        let mut out = Lines::default();
        let mut in_section = false;
        let mut in_instances: Option<usize> = None; // indentation of `instances:`
        let mut item_indent: Option<usize> = None;
        for (index, raw) in source.lines().enumerate() {
            let line_no = index + 1;
            let trimmed = raw.trim_start();
            if trimmed.is_empty() || trimmed.starts_with('#') {
                continue;
            }
            let indent = raw.len() - trimmed.len();
            if indent == 0 {
                in_section = key_of(trimmed) == Some("worker_selection");
                in_instances = None;
                continue;
            }
            if !in_section {
                continue;
            }
            if let Some(base) = in_instances {
                if indent > base || (indent == base && trimmed.starts_with('-')) {
                    if trimmed.starts_with('-') && item_indent.is_none_or(|i| i == indent) {
                        item_indent = Some(indent);
                        out.instances.push(line_no);
                    }
                    continue;
                }
                in_instances = None;
            }
            match key_of(trimmed) {
                Some("instances") => {
                    in_instances = Some(indent);
                    item_indent = None;
                }
                Some(key) => {
                    if let Some(t) = WorkerType::parse(key) {
                        out.roles[t as usize].get_or_insert(line_no);
                    }
                }
                None => {}
            }
        }
        out
    }

    fn role(&self, t: WorkerType) -> Option<usize> {
        self.roles[t as usize]
    }
}

/// The key of a `key: value` line.
fn key_of(line: &str) -> Option<&str> {
    let (key, _) = line.split_once(':')?;
    let key = key.trim().trim_matches(|c| c == '"' || c == '\'');
    (!key.is_empty() && !key.contains(' ')).then_some(key)
}

/// The line of the key at `path` (`["daemon", "max_workers"]`) in a
/// block-style file: each key is looked for among the lines indented
/// deeper than its parent's. When the last keys are not found (a flow
/// mapping like `daemon: {max_workers: 0}`), the line of the deepest one
/// found.
pub fn key_line(source: &str, path: &[&str]) -> Option<usize> {
    let mut found = None;
    let mut parent_indent: Option<usize> = None;
    let mut lines = source.lines().enumerate();
    'keys: for key in path {
        for (n, line) in lines.by_ref() {
            let body = line.trim_start_matches(' ');
            if body.is_empty() || body.starts_with('#') {
                continue;
            }
            let indent = line.len() - body.len();
            if parent_indent.is_some_and(|p| indent <= p) {
                break 'keys;
            }
            let body = body.strip_prefix("- ").unwrap_or(body);
            if let Some(rest) = body.strip_prefix(key)
                && rest.trim_start().starts_with(':')
            {
                found = Some(n + 1);
                parent_indent = Some(indent);
                continue 'keys;
            }
        }
        break;
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEED_YAML: &str = "\
# per-role selection
worker_selection:
  aggregated: least-busy
  prefill: prefill-least-busy
  decode: least-busy
  encode: least-busy
  instances:
    - name: least-busy
      type: least-busy
      parameters:
        min_device_overlap_blocks: 0
    - name: prefill-least-busy
      type: least-busy
      parameters:
        min_device_overlap_blocks: 1
daemon:
  anything: goes
";

    #[test]
    fn parses_the_seed_example_with_lines() {
        let c = WorkerSelectionConfig::from_yaml_str(SEED_YAML).unwrap();
        assert_eq!(
            c.role(WorkerType::Aggregated),
            Some(("least-busy", Some(3)))
        );
        assert_eq!(
            c.role(WorkerType::Prefill),
            Some(("prefill-least-busy", Some(4)))
        );
        assert_eq!(c.role(WorkerType::Encode), Some(("least-busy", Some(6))));
        let names: Vec<_> = c
            .instances()
            .iter()
            .map(|i| (i.name.as_str(), i.line))
            .collect();
        assert_eq!(
            names,
            [("least-busy", Some(8)), ("prefill-least-busy", Some(12))]
        );
        assert_eq!(
            c.instances()[1].parameters["min_device_overlap_blocks"].as_f64(),
            Some(1.0)
        );
    }

    #[test]
    fn missing_section_means_built_in_everywhere() {
        let c = WorkerSelectionConfig::from_yaml_str("daemon: {}\n").unwrap();
        assert!(c.instances().is_empty());
        assert!(WorkerType::ALL.iter().all(|t| c.role(*t).is_none()));
    }

    #[test]
    fn unknown_key_in_section_names_key_and_line() {
        let e = WorkerSelectionConfig::from_yaml_str("worker_selection:\n  agregated: x\n")
            .unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("unknown field `agregated`"), "{msg}");
        assert!(msg.contains("line 2"), "{msg}");
    }
}
