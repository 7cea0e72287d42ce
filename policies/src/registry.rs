//! The plugin registry: type names to providers, and resolution of the YAML
//! configuration into one factory per role.
//!
//! A provider runs once at startup for each configured instance of its type:
//! it parses and validates the parameters and returns a factory. The factory
//! runs once per routing partition (role, model) and returns a fresh policy
//! that owns its state. Nothing here runs per request.
//!
//! Which instance serves a role, first match wins:
//! - prefill and decode: the role-specific override, then the all-roles
//!   override (`--worker-selection-policy` or
//!   `KVEDGE_ROUTER_WORKER_SELECTION_POLICY`), then the YAML role key, then
//!   the built-in policy;
//! - aggregated and encode: the all-roles override, then YAML, then built-in.
//!
//! `default` anywhere selects the built-in. A role never falls back to
//! another role's selection.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::de::DeserializeOwned;

use crate::builtin::register_builtins;
use crate::classifier::{ClassifierConfig, RequestClassifierProvider, ResolvedClassifier};
use crate::config::RouterConfig;
use crate::context::{RoutingPartition, WorkerType};
use crate::error::{
    PolicyConfigError, WorkerSelectionPolicyProviderError, WorkerSelectionPolicyRegistryError,
};
use crate::policy::WorkerSelectionPolicy;
use crate::yaml::WorkerSelectionConfig;

/// Builds a policy for one partition.
pub type WorkerSelectionPolicyFactory = Arc<
    dyn Fn(&RouterConfig, WorkerType, &RoutingPartition) -> WorkerSelectionPolicy + Send + Sync,
>;

/// Validates an instance's parameters and returns its factory.
pub type WorkerSelectionPolicyProvider = Arc<
    dyn Fn(
            &WorkerSelectionPolicyParameters,
        ) -> Result<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError>
        + Send
        + Sync,
>;

/// The environment variable naming one instance for every role.
pub const WORKER_SELECTION_POLICY_ENV: &str = "KVEDGE_ROUTER_WORKER_SELECTION_POLICY";
/// The environment variable naming the prefill role's instance.
pub const PREFILL_POLICY_ENV: &str = "KVEDGE_ROUTER_PREFILL_POLICY";
/// The environment variable naming the decode role's instance.
pub const DECODE_POLICY_ENV: &str = "KVEDGE_ROUTER_DECODE_POLICY";

/// The selection that means "the built-in policy".
pub const DEFAULT_SELECTION: &str = "default";

/// An instance's `parameters`, handed to its provider.
#[derive(Clone, Debug)]
pub struct WorkerSelectionPolicyParameters {
    instance: String,
    value: serde_yaml::Value,
}

impl WorkerSelectionPolicyParameters {
    pub fn new(instance: impl Into<String>, value: serde_yaml::Value) -> Self {
        WorkerSelectionPolicyParameters {
            instance: instance.into(),
            value,
        }
    }

    /// Parameters written as YAML text (tests, tools).
    pub fn from_yaml_str(
        instance: impl Into<String>,
        yaml: &str,
    ) -> Result<Self, WorkerSelectionPolicyProviderError> {
        Ok(Self::new(instance, serde_yaml::from_str(yaml)?))
    }

    /// Deserializes into the provider's parameter type (use
    /// `#[serde(deny_unknown_fields)]` so typos are errors).
    pub fn deserialize<T: DeserializeOwned>(
        &self,
    ) -> Result<T, WorkerSelectionPolicyProviderError> {
        serde_path_to_error::deserialize(self.value.clone()).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if path.is_empty() || path == "." {
                WorkerSelectionPolicyProviderError::new(inner.to_string())
            } else {
                WorkerSelectionPolicyProviderError::new(format!("{path}: {inner}"))
            }
        })
    }

    /// The configured instance name.
    pub fn instance_name(&self) -> &str {
        &self.instance
    }

    pub fn raw(&self) -> &serde_yaml::Value {
        &self.value
    }
}

/// Selections given outside the YAML (command line, environment). Each
/// field is the command-line option, else its environment variable; a
/// role's own override comes before the all-roles one, which comes before
/// the YAML (the plugin API's order).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SelectionOverrides {
    /// All roles: `--worker-selection-policy`, else
    /// [`WORKER_SELECTION_POLICY_ENV`].
    pub all_roles: Option<String>,
    /// Prefill: `--prefill-policy`, else [`PREFILL_POLICY_ENV`].
    pub prefill: Option<String>,
    /// Decode: `--decode-policy`, else [`DECODE_POLICY_ENV`].
    pub decode: Option<String>,
}

impl SelectionOverrides {
    /// Fills each override no option set from its environment variable
    /// (an empty value counts as unset).
    pub fn with_env_fallback(self) -> Self {
        self.with_env(|name| std::env::var(name).ok())
    }

    /// [`SelectionOverrides::with_env_fallback`] reading variables through
    /// `var` (for tests, which cannot set the process's environment safely).
    pub fn with_env(mut self, var: impl Fn(&str) -> Option<String>) -> Self {
        for (field, name) in [
            (&mut self.all_roles, WORKER_SELECTION_POLICY_ENV),
            (&mut self.prefill, PREFILL_POLICY_ENV),
            (&mut self.decode, DECODE_POLICY_ENV),
        ] {
            if field.is_none() {
                *field = var(name).filter(|v| !v.is_empty());
            }
        }
        self
    }
}

/// Type names to providers.
#[derive(Clone, Default)]
pub struct RouterPluginRegistry {
    providers: BTreeMap<String, WorkerSelectionPolicyProvider>,
    /// The types [`router_plugin_registry`] registered: their policies
    /// allow side passes ([`WorkerSelectionPolicy::allow_side_passes`]).
    shipped: std::collections::BTreeSet<String>,
    classifiers: BTreeMap<String, RequestClassifierProvider>,
}

impl fmt::Debug for RouterPluginRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RouterPluginRegistry")
            .field("types", &self.providers.keys().collect::<Vec<_>>())
            .field("classifiers", &self.classifiers.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// The registry under its old name (the plugin API's compatibility alias):
/// the same type, so existing policies register into it unchanged.
#[deprecated(note = "use RouterPluginRegistry")]
pub type WorkerSelectionPolicyRegistry = RouterPluginRegistry;

/// The host registry: every shipped type registered.
pub fn router_plugin_registry() -> RouterPluginRegistry {
    let mut r = RouterPluginRegistry::empty();
    register_builtins(&mut r).expect("built-in type names are valid and distinct");
    r.shipped = r.providers.keys().cloned().collect();
    r
}

/// Whether `type_name` may be registered: a valid name, not `taken`.
fn new_type_name(type_name: &str, taken: bool) -> Result<(), WorkerSelectionPolicyRegistryError> {
    if !valid_name(type_name, false) {
        return Err(WorkerSelectionPolicyRegistryError::InvalidTypeName(
            type_name.to_owned(),
        ));
    }
    if taken {
        return Err(WorkerSelectionPolicyRegistryError::DuplicateType(
            type_name.to_owned(),
        ));
    }
    Ok(())
}

fn valid_name(name: &str, allow_upper: bool) -> bool {
    (1..=64).contains(&name.len())
        && name != DEFAULT_SELECTION
        && name.bytes().all(|b| {
            b.is_ascii_lowercase()
                || b.is_ascii_digit()
                || matches!(b, b'-' | b'_' | b'.')
                || (allow_upper && b.is_ascii_uppercase())
        })
}

impl RouterPluginRegistry {
    /// A registry with nothing registered (tests, custom hosts).
    pub fn empty() -> Self {
        RouterPluginRegistry::default()
    }

    /// Registers `type_name`. Names are 1-64 characters of `a-z 0-9 - _ .`,
    /// not `default`, and registered once.
    pub fn register_worker_selection(
        &mut self,
        type_name: &str,
        provider: WorkerSelectionPolicyProvider,
    ) -> Result<(), WorkerSelectionPolicyRegistryError> {
        new_type_name(type_name, self.providers.contains_key(type_name))?;
        self.providers.insert(type_name.to_owned(), provider);
        Ok(())
    }

    /// The worker-only registration method under its old name, kept as the
    /// plugin API keeps it for policies written against earlier releases.
    #[deprecated(note = "use register_worker_selection")]
    pub fn register(
        &mut self,
        type_name: &str,
        provider: WorkerSelectionPolicyProvider,
    ) -> Result<(), WorkerSelectionPolicyRegistryError> {
        self.register_worker_selection(type_name, provider)
    }

    pub fn contains(&self, type_name: &str) -> bool {
        self.providers.contains_key(type_name)
    }

    /// Registers the request-classifier type `type_name` (the same naming
    /// rules as a worker-selection type; a namespace of its own).
    pub fn register_request_classifier(
        &mut self,
        type_name: &str,
        provider: RequestClassifierProvider,
    ) -> Result<(), WorkerSelectionPolicyRegistryError> {
        new_type_name(type_name, self.classifiers.contains_key(type_name))?;
        self.classifiers.insert(type_name.to_owned(), provider);
        Ok(())
    }

    /// The registered classifier types.
    pub fn classifier_names(&self) -> impl Iterator<Item = &str> {
        self.classifiers.keys().map(String::as_str)
    }

    /// The configured classifier, validated: its type registered and its
    /// parameters accepted. `None` without a `request_classifier:` section.
    pub fn resolve_classifier(
        &self,
        config: Option<&ClassifierConfig>,
    ) -> Result<Option<ResolvedClassifier>, PolicyConfigError> {
        let Some(c) = config else {
            return Ok(None);
        };
        let provider =
            self.classifiers
                .get(&c.type_name)
                .ok_or_else(|| PolicyConfigError::Classifier {
                    message: format!(
                        "unknown type `{}` (registered: {})",
                        c.type_name,
                        self.classifier_names().collect::<Vec<_>>().join(", ")
                    ),
                })?;
        let parameters = match &c.parameters {
            None | Some(serde_yaml::Value::Null) => {
                serde_yaml::Value::Mapping(serde_yaml::Mapping::new())
            }
            Some(v) => v.clone(),
        };
        let params = WorkerSelectionPolicyParameters::new("request_classifier", parameters);
        let factory = provider(&params).map_err(|e| PolicyConfigError::Classifier {
            message: format!(
                "type `{}`: invalid parameters: {}",
                c.type_name,
                e.message()
            ),
        })?;
        Ok(Some(ResolvedClassifier {
            type_name: c.type_name.clone(),
            factory,
        }))
    }

    pub fn type_names(&self) -> impl Iterator<Item = &str> {
        self.providers.keys().map(String::as_str)
    }

    /// Validates the configuration: every instance's type exists and its
    /// provider accepts the parameters, names are unique, and every selection
    /// names `default` or an instance. Returns the factory per role.
    pub fn resolve_plugins(
        &self,
        config: &WorkerSelectionConfig,
        overrides: &SelectionOverrides,
        router: &RouterConfig,
    ) -> Result<RouterPlugins, PolicyConfigError> {
        router
            .validate()
            .map_err(|message| PolicyConfigError::Yaml {
                line: None,
                message: format!("router configuration: {message}"),
            })?;
        let mut built: BTreeMap<&str, (Arc<ResolvedInstance>, Option<usize>)> = BTreeMap::new();
        for inst in config.instances() {
            if !valid_name(&inst.name, true) {
                return Err(PolicyConfigError::InvalidInstanceName {
                    instance: inst.name.clone(),
                    line: inst.line,
                });
            }
            if let Some((_, first_line)) = built.get(inst.name.as_str()) {
                return Err(PolicyConfigError::DuplicateInstance {
                    instance: inst.name.clone(),
                    line: inst.line,
                    first_line: *first_line,
                });
            }
            let provider = self.providers.get(&inst.type_name).ok_or_else(|| {
                PolicyConfigError::UnknownType {
                    instance: inst.name.clone(),
                    type_name: inst.type_name.clone(),
                    line: inst.line,
                    known: self.type_names().collect::<Vec<_>>().join(", "),
                }
            })?;
            let params = WorkerSelectionPolicyParameters::new(&inst.name, inst.parameters.clone());
            let factory = provider(&params).map_err(|e| PolicyConfigError::InvalidParameters {
                instance: inst.name.clone(),
                type_name: inst.type_name.clone(),
                line: inst.line,
                message: e.message().to_owned(),
            })?;
            let resolved = ResolvedInstance {
                name: inst.name.clone(),
                type_name: inst.type_name.clone(),
                factory,
                shipped: self.shipped.contains(&inst.type_name),
            };
            built.insert(inst.name.as_str(), (Arc::new(resolved), inst.line));
        }
        let configured = || {
            let names: Vec<&str> = built.keys().copied().collect();
            if names.is_empty() {
                "none".to_owned()
            } else {
                names.join(", ")
            }
        };
        let lookup = |name: &str, scope: String, line: Option<usize>| {
            if name == DEFAULT_SELECTION {
                return Ok(None);
            }
            built
                .get(name)
                .map(|(r, _)| Some(Arc::clone(r)))
                .ok_or_else(|| PolicyConfigError::UnknownSelection {
                    scope,
                    name: name.to_owned(),
                    line,
                    configured: configured(),
                })
        };
        let mut roles: [Option<Arc<ResolvedInstance>>; 4] = Default::default();
        for role in WorkerType::ALL {
            let specific = match role {
                WorkerType::Prefill => overrides
                    .prefill
                    .as_deref()
                    .map(|n| (n, format!("--prefill-policy / {PREFILL_POLICY_ENV}"))),
                WorkerType::Decode => overrides
                    .decode
                    .as_deref()
                    .map(|n| (n, format!("--decode-policy / {DECODE_POLICY_ENV}"))),
                _ => None,
            };
            let chosen = if let Some((name, option)) = specific {
                lookup(name, format!("{role} override {option}"), None)?
            } else if let Some(name) = overrides.all_roles.as_deref() {
                lookup(
                    name,
                    format!(
                        "all-roles override (--worker-selection-policy / {WORKER_SELECTION_POLICY_ENV})"
                    ),
                    None,
                )?
            } else if let Some((name, line)) = config.role(role) {
                lookup(name, format!("worker_selection.{role}"), line)?
            } else {
                None
            };
            roles[role as usize] = chosen;
        }
        let instances = built
            .into_iter()
            .map(|(name, (r, _))| (name.to_owned(), r))
            .collect();
        Ok(RouterPlugins {
            router: router.clone(),
            roles,
            instances,
            classifier: None,
        })
    }
}

struct ResolvedInstance {
    name: String,
    type_name: String,
    factory: WorkerSelectionPolicyFactory,
    /// A shipped type: its policies allow side passes.
    shipped: bool,
}

impl ResolvedInstance {
    fn build(&self, router: &RouterConfig, partition: &RoutingPartition) -> WorkerSelectionPolicy {
        let policy = (self.factory)(router, partition.worker_type, partition);
        if self.shipped {
            policy.allow_side_passes()
        } else {
            policy
        }
    }
}

/// The resolved configuration: what to build for each role.
#[derive(Clone)]
pub struct RouterPlugins {
    router: RouterConfig,
    roles: [Option<Arc<ResolvedInstance>>; 4],
    /// Every configured instance, by name (rules may rank by any of them).
    instances: BTreeMap<String, Arc<ResolvedInstance>>,
    /// The request classifier, when one is configured.
    classifier: Option<ResolvedClassifier>,
}

impl fmt::Debug for RouterPlugins {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("RouterPlugins");
        for role in WorkerType::ALL {
            d.field(role.as_str(), &self.selection(role));
        }
        d.finish()
    }
}

impl RouterPlugins {
    /// Every role on the built-in policy.
    pub fn builtin_only(router: RouterConfig) -> Self {
        RouterPlugins {
            router,
            roles: Default::default(),
            instances: BTreeMap::new(),
            classifier: None,
        }
    }

    /// These plugins with `classifier` running before every selection.
    pub fn with_classifier(mut self, classifier: Option<ResolvedClassifier>) -> Self {
        self.classifier = classifier;
        self
    }

    /// The configured request classifier.
    pub fn classifier(&self) -> Option<&ResolvedClassifier> {
        self.classifier.as_ref()
    }

    /// `(instance name, type name)` serving `role`, or `("default", the
    /// built-in type for the role)` ([`crate::builtin::builtin_type`]).
    pub fn selection(&self, role: WorkerType) -> (&str, &str) {
        match &self.roles[role as usize] {
            Some(r) => (&r.name, &r.type_name),
            None => (DEFAULT_SELECTION, crate::builtin::builtin_type(role)),
        }
    }

    pub fn router_config(&self) -> &RouterConfig {
        &self.router
    }

    /// Whether `name` is a configured instance or `default`.
    pub fn has_instance(&self, name: &str) -> bool {
        name == DEFAULT_SELECTION || self.instances.contains_key(name)
    }

    /// A fresh policy of the instance called `name` (or the built-in for
    /// `default`), for `partition`.
    pub fn build_instance(
        &self,
        name: &str,
        partition: &RoutingPartition,
    ) -> Option<WorkerSelectionPolicy> {
        if name == DEFAULT_SELECTION {
            return Some(crate::builtin::builtin_policy(&self.router, partition));
        }
        let r = self.instances.get(name)?;
        Some(r.build(&self.router, partition))
    }

    /// A fresh policy instance for `partition`.
    pub fn build(&self, partition: &RoutingPartition) -> WorkerSelectionPolicy {
        match &self.roles[partition.worker_type as usize] {
            Some(r) => r.build(&self.router, partition),
            None => crate::builtin::builtin_policy(&self.router, partition),
        }
    }
}
