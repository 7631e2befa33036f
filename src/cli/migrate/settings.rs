//! `haulage migrate`'s flags, validated once into [`MigrateSettings`]:
//! the maps (`SRC=DST`), the size policy (`requested`, `used`,
//! `used+30%`), the label selector, and the migration's name, from which
//! every object it creates is named ([`Pass::object_name`]). Pure: no
//! cluster is read here.

use std::collections::{BTreeMap, BTreeSet};

use crate::api::names::{MAX_LABEL_LENGTH, hashed_dns_label};
use crate::api::restore::{SizeChoice, SizePolicy};
use crate::plan::LabelSelector;

/// Prefix of a migration's default name (`migrate-shop-web`).
pub const DEFAULT_NAME_PREFIX: &str = "migrate";
/// Longest migration name: `<name>-final` must still be a DNS label.
pub const MAX_NAME_LENGTH: usize = MAX_LABEL_LENGTH - FINAL_SUFFIX.len();
/// Suffix of the first pass's objects.
const FIRST_SUFFIX: &str = "-1";
/// Suffix of the cutover pass's objects.
const FINAL_SUFFIX: &str = "-final";

/// The two passes of a migration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Pass {
    /// The full copy while the workloads run.
    First,
    /// The cutover after quiescing: an incremental backup and a `Sync`
    /// restore.
    Final,
}

impl Pass {
    /// The name of this pass's VolumeBackup (on the source) and
    /// VolumeRestore (on the destination): `<name>-1`, `<name>-final`.
    pub fn object_name(self, migration: &str) -> String {
        let suffix = match self {
            Pass::First => FIRST_SUFFIX,
            Pass::Final => FINAL_SUFFIX,
        };
        format!("{migration}{suffix}")
    }

    /// How the pass is called in the progress display and the report.
    pub fn label(self) -> &'static str {
        match self {
            Pass::First => "first pass",
            Pass::Final => "final pass",
        }
    }
}

/// A flag value that cannot be used, with what to write instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingsError {
    /// A map entry is not `SRC=DST`.
    #[error("{flag} {value:?}: expected SRC=DST, e.g. {flag} {example}")]
    MapEntry {
        /// The flag.
        flag: &'static str,
        /// What was given.
        value: String,
        /// A valid entry.
        example: &'static str,
    },
    /// The same source twice in one map.
    #[error("{flag} maps {source_name} twice ({first} and {second}): give each source once")]
    DuplicateMapEntry {
        /// The flag.
        flag: &'static str,
        /// The source named twice.
        source_name: String,
        /// Its first destination.
        first: String,
        /// Its second destination.
        second: String,
    },
    /// The size policy does not parse.
    #[error(
        "--size {0:?}: expected `requested`, `used` or `used+N%` (e.g. used+30%, N at most 1000)"
    )]
    Size(String),
    /// The selector does not parse.
    #[error("--selector: {0}")]
    Selector(#[from] crate::plan::selector::SelectorError),
    /// No namespace given.
    #[error("name the namespaces to migrate with -n/--namespace (repeat it for several)")]
    NoNamespace,
    /// A namespace name is not a DNS label.
    #[error("-n {0:?} is not a namespace name (lowercase letters, digits and '-', at most 63)")]
    NamespaceName(String),
    /// The migration's name is not usable.
    #[error(
        "--name {0:?}: use lowercase letters, digits and '-', starting and ending with a letter or digit, at most {MAX_NAME_LENGTH} characters (its objects are named <name>-1 and <name>-final)"
    )]
    Name(String),
}

/// The validated settings of one migration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrateSettings {
    /// The migration's name; its objects are [`Pass::object_name`].
    pub name: String,
    /// Source namespaces, sorted, without duplicates.
    pub namespaces: Vec<String>,
    /// The claims of those namespaces to move (kubectl syntax), as given.
    pub selector: Option<String>,
    /// [`MigrateSettings::selector`], parsed.
    pub labels: LabelSelector,
    /// Source namespace → destination namespace.
    pub namespace_map: BTreeMap<String, String>,
    /// Source storage class → destination storage class.
    pub storage_class_map: BTreeMap<String, String>,
    /// Source provisioner → destination storage class.
    pub provisioner_map: BTreeMap<String, String>,
    /// Create destination namespaces that do not exist.
    pub create_namespaces: bool,
    /// Keep ReadOnlyMany claims ReadWriteOnce on the destination.
    pub keep_writable: bool,
    /// How big the destination claims are.
    pub size: SizePolicy,
    /// BackupStorageLocation on the source (`None`: its default one).
    pub from_location: Option<String>,
    /// BackupStorageLocation on the destination (`None`: its default one).
    pub to_location: Option<String>,
    /// Namespace of the controller, its locations, backups and restores on
    /// both clusters.
    pub controller_namespace: String,
    /// Quiesce the workloads and run the cutover pass.
    pub quiesce: bool,
}

impl MigrateSettings {
    /// The destination namespace of source namespace `namespace`.
    pub fn destination_namespace<'a>(&'a self, namespace: &'a str) -> &'a str {
        self.namespace_map
            .get(namespace)
            .map_or(namespace, String::as_str)
    }

    /// The destination namespaces, sorted.
    pub fn destination_namespaces(&self) -> Vec<String> {
        self.namespaces
            .iter()
            .map(|namespace| self.destination_namespace(namespace).to_string())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect()
    }
}

/// `SRC=DST` entries of `flag` as a map; each source at most once.
pub fn parse_map(
    flag: &'static str,
    example: &'static str,
    entries: &[String],
) -> Result<BTreeMap<String, String>, SettingsError> {
    let mut map = BTreeMap::new();
    for entry in entries {
        let Some((source, destination)) = entry.split_once('=') else {
            return Err(SettingsError::MapEntry {
                flag,
                value: entry.clone(),
                example,
            });
        };
        let (source, destination) = (source.trim(), destination.trim());
        if source.is_empty() || destination.is_empty() || destination.contains('=') {
            return Err(SettingsError::MapEntry {
                flag,
                value: entry.clone(),
                example,
            });
        }
        if let Some(first) = map.insert(source.to_string(), destination.to_string()) {
            return Err(SettingsError::DuplicateMapEntry {
                flag,
                source_name: source.to_string(),
                first,
                second: destination.to_string(),
            });
        }
    }
    Ok(map)
}

/// `--size`: `requested` (the source claim's request), `used` (the bytes
/// in use plus the default headroom) or `used+N%`.
pub fn parse_size(text: &str) -> Result<SizePolicy, SettingsError> {
    let refuse = || SettingsError::Size(text.to_string());
    match text.trim() {
        "requested" => Ok(SizePolicy {
            policy: SizeChoice::Requested,
            headroom_percent: None,
        }),
        "used" => Ok(SizePolicy {
            policy: SizeChoice::UsedPlusHeadroom,
            headroom_percent: None,
        }),
        other => {
            let percent = other
                .strip_prefix("used+")
                .and_then(|rest| rest.strip_suffix('%'))
                .ok_or_else(refuse)?;
            let percent: u32 = percent.trim().parse().map_err(|_| refuse())?;
            if percent > 1000 {
                return Err(refuse());
            }
            Ok(SizePolicy {
                policy: SizeChoice::UsedPlusHeadroom,
                headroom_percent: Some(percent),
            })
        }
    }
}

fn is_dns_label(text: &str, limit: usize) -> bool {
    !text.is_empty()
        && text.len() <= limit
        && text
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !text.starts_with('-')
        && !text.ends_with('-')
}

/// The name of a migration of `namespaces` when `--name` is not given:
/// `migrate-<namespaces joined by ->`, shortened with a hash when long.
pub fn default_name(namespaces: &[String]) -> String {
    let readable = format!("{DEFAULT_NAME_PREFIX}-{}", namespaces.join("-"));
    if readable.len() <= MAX_NAME_LENGTH {
        return readable;
    }
    let identity: Vec<&str> = namespaces.iter().map(String::as_str).collect();
    hashed_dns_label(&readable, &identity, MAX_NAME_LENGTH)
}

/// The flags that make [`MigrateSettings`], before validation.
#[derive(Debug, Clone, Default)]
pub struct RawSettings {
    /// `-n`, repeated.
    pub namespaces: Vec<String>,
    /// `--selector`.
    pub selector: Option<String>,
    /// `--namespace-map`, repeated.
    pub namespace_map: Vec<String>,
    /// `--storage-class-map`, repeated.
    pub storage_class_map: Vec<String>,
    /// `--provisioner-map`, repeated.
    pub provisioner_map: Vec<String>,
    /// `--create-namespaces`.
    pub create_namespaces: bool,
    /// `--keep-writable`.
    pub keep_writable: bool,
    /// `--size`.
    pub size: String,
    /// `--from-location`.
    pub from_location: Option<String>,
    /// `--to-location`.
    pub to_location: Option<String>,
    /// `--name`.
    pub name: Option<String>,
    /// `--controller-namespace`.
    pub controller_namespace: String,
    /// `--quiesce`.
    pub quiesce: bool,
}

impl RawSettings {
    /// Validate the flags.
    pub fn validate(self) -> Result<MigrateSettings, SettingsError> {
        let namespaces: Vec<String> = self
            .namespaces
            .iter()
            .map(|namespace| namespace.trim().to_string())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        if namespaces.is_empty() {
            return Err(SettingsError::NoNamespace);
        }
        if let Some(bad) = namespaces
            .iter()
            .find(|namespace| !is_dns_label(namespace, MAX_LABEL_LENGTH))
        {
            return Err(SettingsError::NamespaceName(bad.clone()));
        }
        let name = match self.name {
            Some(name) if is_dns_label(&name, MAX_NAME_LENGTH) => name,
            Some(name) => return Err(SettingsError::Name(name)),
            None => default_name(&namespaces),
        };
        let selector = self.selector.filter(|text| !text.trim().is_empty());
        let labels = LabelSelector::parse(selector.as_deref().unwrap_or(""))?;
        Ok(MigrateSettings {
            name,
            namespaces,
            selector,
            labels,
            namespace_map: parse_map("--namespace-map", "shop=shop-b", &self.namespace_map)?,
            storage_class_map: parse_map(
                "--storage-class-map",
                "ceph-block=gp3",
                &self.storage_class_map,
            )?,
            provisioner_map: parse_map(
                "--provisioner-map",
                "rook-ceph.rbd.csi.ceph.com=gp3",
                &self.provisioner_map,
            )?,
            create_namespaces: self.create_namespaces,
            keep_writable: self.keep_writable,
            size: parse_size(&self.size)?,
            from_location: self.from_location,
            to_location: self.to_location,
            controller_namespace: self.controller_namespace,
            quiesce: self.quiesce,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw() -> RawSettings {
        RawSettings {
            namespaces: vec!["web".to_string(), "shop".to_string(), "web".to_string()],
            size: "requested".to_string(),
            controller_namespace: "haulage-system".to_string(),
            ..RawSettings::default()
        }
    }

    #[test]
    fn namespaces_are_sorted_once_and_name_the_migration_and_its_objects() {
        let settings = raw().validate().expect("valid");
        assert_eq!(settings.namespaces, ["shop", "web"]);
        assert_eq!(settings.name, "migrate-shop-web");
        assert_eq!(
            Pass::First.object_name(&settings.name),
            "migrate-shop-web-1"
        );
        assert_eq!(
            Pass::Final.object_name(&settings.name),
            "migrate-shop-web-final"
        );
    }

    #[test]
    fn a_long_default_name_is_shortened_with_a_hash_and_stays_a_label_with_its_suffix() {
        let namespaces: Vec<String> = (0..12).map(|n| format!("team-number-{n}")).collect();
        let name = default_name(&namespaces);
        assert!(name.len() <= MAX_NAME_LENGTH, "{name}");
        assert!(is_dns_label(
            &Pass::Final.object_name(&name),
            MAX_LABEL_LENGTH
        ));
        let mut other = namespaces.clone();
        other[11] = "team-number-99".to_string();
        assert_ne!(
            name,
            default_name(&other),
            "distinct namespaces, distinct names"
        );
    }

    #[test]
    fn a_bad_name_or_namespace_is_refused_naming_it() {
        let mut bad = raw();
        bad.name = Some("Shop_Move".to_string());
        let error = bad.validate().expect_err("not a label");
        assert!(error.to_string().contains("\"Shop_Move\""), "{error}");
        let mut bad = raw();
        bad.name = Some("a".repeat(MAX_NAME_LENGTH + 1));
        assert!(matches!(bad.validate(), Err(SettingsError::Name(_))));
        let mut bad = raw();
        bad.namespaces = vec!["Shop".to_string()];
        assert_eq!(
            bad.validate(),
            Err(SettingsError::NamespaceName("Shop".to_string()))
        );
        let mut none = raw();
        none.namespaces.clear();
        assert_eq!(none.validate(), Err(SettingsError::NoNamespace));
    }

    #[test]
    fn maps_take_src_equals_dst_once_per_source() {
        let map = parse_map(
            "--namespace-map",
            "shop=shop-b",
            &["shop=shop-b".to_string(), " web = web-b ".to_string()],
        )
        .expect("valid");
        assert_eq!(map.get("shop").map(String::as_str), Some("shop-b"));
        assert_eq!(map.get("web").map(String::as_str), Some("web-b"));
        for bad in ["shop", "shop=", "=shop-b", "a=b=c"] {
            let error =
                parse_map("--namespace-map", "shop=shop-b", &[bad.to_string()]).expect_err(bad);
            assert!(
                error.to_string().contains("expected SRC=DST"),
                "{bad}: {error}"
            );
        }
        let twice = parse_map(
            "--storage-class-map",
            "ceph=gp3",
            &["ceph=gp3".to_string(), "ceph=standard".to_string()],
        )
        .expect_err("twice");
        assert!(twice.to_string().contains("maps ceph twice"), "{twice}");
    }

    #[test]
    fn sizes_are_requested_used_or_used_plus_a_percentage() {
        assert_eq!(
            parse_size("requested").expect("valid").policy,
            SizeChoice::Requested
        );
        assert_eq!(
            parse_size("used").expect("valid"),
            SizePolicy {
                policy: SizeChoice::UsedPlusHeadroom,
                headroom_percent: None
            }
        );
        assert_eq!(
            parse_size("used+30%").expect("valid").headroom_percent,
            Some(30)
        );
        for bad in ["used+30", "used+x%", "used+2000%", "all", ""] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_selector_is_parsed_and_a_bad_one_refused() {
        let mut with = raw();
        with.selector = Some("app=db,tier!=cache".to_string());
        let settings = with.validate().expect("valid");
        assert_eq!(settings.labels.requirements.len(), 2);
        let mut bad = raw();
        bad.selector = Some("env in (prod".to_string());
        assert!(matches!(bad.validate(), Err(SettingsError::Selector(_))));
    }

    #[test]
    fn destination_namespaces_follow_the_map() {
        let mut mapped = raw();
        mapped.namespace_map = vec!["shop=shop-b".to_string()];
        let settings = mapped.validate().expect("valid");
        assert_eq!(settings.destination_namespace("shop"), "shop-b");
        assert_eq!(settings.destination_namespace("web"), "web");
        assert_eq!(settings.destination_namespaces(), ["shop-b", "web"]);
    }
}
