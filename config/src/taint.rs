//! Engines' taints, `key[=value]:NoSchedule` or `key[=value]:PreferNoSchedule`
//! as Kubernetes writes them: parsed once here, for the `engines:` section's
//! validation and for the routing core's registration alike.

/// What a taint does to a request that does not tolerate it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TaintEffect {
    /// The worker is not a candidate (a required routing constraint).
    NoSchedule,
    /// The worker's cost is multiplied by `router.preferred_taint_multiplier`
    /// (a preferred routing constraint, the `PREFERRED_TAINT` signal).
    PreferNoSchedule,
}

/// An engine's taint. A request tolerates it with `key` (any value) or
/// `key=value`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Taint {
    pub key: String,
    pub value: Option<String>,
    pub effect: TaintEffect,
}

impl Taint {
    /// Parses `key[=value]:NoSchedule` or `key[=value]:PreferNoSchedule`;
    /// `None` for anything else.
    pub fn parse(s: &str) -> Option<Taint> {
        let (kv, effect) = s.rsplit_once(':')?;
        let effect = match effect {
            "NoSchedule" => TaintEffect::NoSchedule,
            "PreferNoSchedule" => TaintEffect::PreferNoSchedule,
            _ => return None,
        };
        let (key, value) = match kv.split_once('=') {
            Some((k, v)) => (k, Some(v.to_owned())),
            None => (kv, None),
        };
        if key.is_empty() || key.contains(':') {
            return None;
        }
        Some(Taint {
            key: key.to_owned(),
            value,
            effect,
        })
    }

    /// Whether one of `tolerations` (`key` or `key=value`) tolerates it.
    pub fn tolerated_by<'t>(&self, mut tolerations: impl Iterator<Item = &'t str>) -> bool {
        tolerations.any(|t| match t.split_once('=') {
            Some((k, v)) => k == self.key && self.value.as_deref() == Some(v),
            None => t == self.key,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn taints_parse_and_tolerations_match_key_or_key_and_value() {
        let t = Taint::parse("gpu=a10:PreferNoSchedule").unwrap();
        assert_eq!(
            (t.key.as_str(), t.value.as_deref(), t.effect),
            ("gpu", Some("a10"), TaintEffect::PreferNoSchedule)
        );
        assert!(t.tolerated_by(["gpu"].into_iter()));
        assert!(t.tolerated_by(["x", "gpu=a10"].into_iter()));
        assert!(!t.tolerated_by(["gpu=h100"].into_iter()));
        for bad in [
            "spot",
            "spot:Sometimes",
            ":NoSchedule",
            "=v:NoSchedule",
            "a:b:NoSchedule",
        ] {
            assert_eq!(Taint::parse(bad), None, "{bad}");
        }
    }
}
