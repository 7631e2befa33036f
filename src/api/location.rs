//! `BackupStorageLocation` (`bsl`): an S3 bucket and prefix that holds a
//! haulage repository, the Secret with its credentials, and the limits the
//! agents keep to when they write there. The controller probes it when it
//! is created or changed and every `validationFrequency`, and sets
//! `status.phase` (docs/controller.md).

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::condition::Condition;
use crate::progress::{DurationError, parse_duration};

/// `validationFrequency` when the spec leaves it out.
pub const DEFAULT_VALIDATION_FREQUENCY: &str = "1m";
/// Key in the credentials Secret when the spec leaves it out (Velero's).
pub const DEFAULT_CREDENTIAL_KEY: &str = "cloud";

/// Where backups are stored: an S3-compatible bucket and prefix.
#[allow(
    clippy::duplicated_attributes,
    reason = "each kube printcolumn(...) repeats the same keys"
)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "haulage.dev",
    version = "v1alpha1",
    kind = "BackupStorageLocation",
    plural = "backupstoragelocations",
    shortname = "bsl",
    category = "haulage",
    namespaced,
    status = "BackupStorageLocationStatus",
    derive = "PartialEq",
    doc = "An S3-compatible bucket and prefix holding a haulage repository, with its credentials and limits",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Bucket", type_ = "string", json_path = ".spec.bucket"),
    printcolumn(
        name = "Prefix",
        type_ = "string",
        json_path = ".spec.prefix",
        priority = 1
    ),
    printcolumn(
        name = "Default",
        type_ = "boolean",
        json_path = ".spec.default",
        priority = 1
    ),
    printcolumn(
        name = "Maintenance",
        type_ = "string",
        json_path = ".status.maintenance.result",
        priority = 1
    ),
    printcolumn(
        name = "Last Validated",
        type_ = "date",
        json_path = ".status.lastValidationTime"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct BackupStorageLocationSpec {
    /// Bucket name.
    #[schemars(length(min = 1, max = 255))]
    #[x_kube(validation = Rule::new("self.trim() == self && !self.contains('/')").message("must be a bucket name without slashes or surrounding spaces"))]
    pub bucket: String,
    /// Key prefix of the repository inside the bucket (no leading slash).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 512))]
    #[x_kube(validation = Rule::new("!self.startsWith('/')").message("must not start with a slash"))]
    pub prefix: Option<String>,
    /// S3 endpoint URL (`https://rgw.example:443`); absent for AWS S3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 2048))]
    #[x_kube(validation = Rule::new("self.startsWith('https://') || self.startsWith('http://')").message("must be an http:// or https:// URL"))]
    pub endpoint: Option<String>,
    /// Region to sign requests for (`us-east-1` when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub region: Option<String>,
    /// Address buckets by path (`endpoint/bucket/key`) rather than by host
    /// name; most non-AWS servers (MinIO, Ceph RGW) need it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s3_force_path_style: Option<bool>,
    /// The Secret (in this namespace) and key holding the credentials, in
    /// the AWS credentials-file format (`[default]`,
    /// `aws_access_key_id = ...`, `aws_secret_access_key = ...`), as Velero
    /// reads them.
    pub credential: SecretKeyReference,
    /// PEM certificates to trust for the endpoint, in addition to the
    /// system roots (a private CA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 65536))]
    #[x_kube(validation = Rule::new("self.contains('-----BEGIN CERTIFICATE-----')").message("must hold PEM certificates"))]
    pub ca_bundle: Option<String>,
    /// Whether VolumeBackups that name no location use this one.
    #[serde(default, rename = "default")]
    pub is_default: bool,
    /// How often the controller probes the location: a duration such as
    /// `30s`, `5m` or `1h` (each location's period is shifted by a fixed
    /// amount of up to ±10 % so locations do not probe together); `0`
    /// probes only when the location is created or its spec changes.
    #[serde(default = "default_validation_frequency")]
    #[schemars(length(max = 32))]
    #[x_kube(validation = Rule::new("self.matches('^(0|([0-9]+(h|m|s|ms))+)$')").message("must be a duration such as 30s, 5m, 1h30m, or 0 to disable validation"))]
    pub validation_frequency: String,
    /// Upload bandwidth cap of all agents writing here together, bytes per
    /// second; unlimited when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub upload_bytes_per_second: Option<i64>,
    /// Volumes moved to or from this location at the same time, over all
    /// backups and restores (the controller admits no more); unlimited when
    /// absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_concurrent_volumes: Option<i32>,
    /// Cap on concurrent requests to the endpoint, over all agents;
    /// unlimited when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10000))]
    pub max_concurrent_requests: Option<i32>,
    /// Create the repository when the prefix holds none (otherwise a
    /// missing repository makes the location Unavailable).
    #[serde(default)]
    pub initialize: bool,
    /// Encryption at rest: the repository's password, from a Secret in
    /// this namespace. With it the controller creates (`initialize`) an
    /// encrypted repository and opens it with this password, and the
    /// agents get the password with their credentials; without it the
    /// repository is plaintext.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encryption: Option<LocationEncryption>,
    /// Scheduled maintenance of the repository: the controller prunes it
    /// (`haulage prune`) every `interval` under the repository's locks, and
    /// records the last run in `status.maintenance`. Absent: the
    /// repository is never pruned by the controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub maintenance: Option<LocationMaintenance>,
}

/// `maintenance.safetyMargin` when the spec leaves it out (`haulage
/// prune`'s default).
pub const DEFAULT_MAINTENANCE_SAFETY_MARGIN: &str = "24h";
/// `maintenance.keepCheckpointsWithin` when the spec leaves it out, and
/// `haulage prune --keep-checkpoints-within`'s default: a week, longer than
/// an agent or node is expected to stay down and come back to its backup.
/// A running backup writes a new checkpoint every minute or so, so its own
/// is never that old.
pub const DEFAULT_KEEP_CHECKPOINTS_WITHIN: &str = "168h";
/// `maintenance.repackThresholdPercent` when the spec leaves it out.
pub const DEFAULT_MAINTENANCE_REPACK_THRESHOLD_PERCENT: i32 = 10;

/// When and how the controller prunes a location's repository.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct LocationMaintenance {
    /// Time between the starts of two prunes, such as `24h` or `168h`
    /// (each location's period is shifted by a fixed amount of up to
    /// ±10 %). The first prune runs when maintenance is set, and a change
    /// of the location's spec runs one at once.
    #[schemars(length(min = 1, max = 32))]
    #[x_kube(validation = Rule::new("self.matches('^([0-9]+(h|m|s|ms))+$')").message("must be a duration such as 24h or 168h"))]
    pub interval: String,
    /// A pack no snapshot needs is deleted only by a prune at least this
    /// long after one found it unneeded (`haulage prune --safety-margin`):
    /// a duration such as `24h`, or `0` to delete in the same run.
    #[serde(default = "default_maintenance_safety_margin")]
    #[schemars(length(min = 1, max = 32))]
    #[x_kube(validation = Rule::new("self.matches('^(0|([0-9]+(h|m|s|ms))+)$')").message("must be a duration such as 24h, or 0"))]
    pub safety_margin: String,
    /// The checkpoint of an unfinished backup written within this is kept
    /// with the data it names, so its backup can still continue from it;
    /// an older one is deleted (`haulage prune --keep-checkpoints-within`):
    /// a duration such as `168h`, or `0` to delete every checkpoint.
    #[serde(default = "default_keep_checkpoints_within")]
    #[schemars(length(min = 1, max = 32))]
    #[x_kube(validation = Rule::new("self.matches('^(0|([0-9]+(h|m|s|ms))+)$')").message("must be a duration such as 168h, or 0"))]
    pub keep_checkpoints_within: String,
    /// Packs whose unused share of bytes is above this percentage are
    /// rewritten (`haulage prune --repack-threshold`).
    #[serde(default = "default_maintenance_repack_threshold_percent")]
    #[schemars(range(min = 0, max = 100))]
    pub repack_threshold_percent: i32,
}

fn default_maintenance_safety_margin() -> String {
    DEFAULT_MAINTENANCE_SAFETY_MARGIN.to_string()
}

fn default_keep_checkpoints_within() -> String {
    DEFAULT_KEEP_CHECKPOINTS_WITHIN.to_string()
}

fn default_maintenance_repack_threshold_percent() -> i32 {
    DEFAULT_MAINTENANCE_REPACK_THRESHOLD_PERCENT
}

impl LocationMaintenance {
    /// The interval between prunes; never zero.
    pub fn interval(&self) -> Result<Duration, DurationError> {
        let interval = parse_duration(&self.interval)?;
        if interval.is_zero() {
            return Err(DurationError {
                text: self.interval.clone(),
                problem: "must be longer than zero",
            });
        }
        Ok(interval)
    }

    /// The safety margin of each prune.
    pub fn safety_margin(&self) -> Result<Duration, DurationError> {
        parse_duration(&self.safety_margin)
    }

    /// How long each prune keeps a checkpoint.
    pub fn keep_checkpoints_within(&self) -> Result<Duration, DurationError> {
        parse_duration(&self.keep_checkpoints_within)
    }
}

/// How a location's repository is encrypted.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LocationEncryption {
    /// The Secret (in this namespace) and key whose value is the
    /// repository's password (its first line, as `haulage
    /// --password-file` reads a file).
    pub password_secret_ref: PasswordSecretReference,
}

/// A key of a Secret in the referring object's namespace, both named.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PasswordSecretReference {
    /// Secret name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Key inside the Secret's data.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

fn default_validation_frequency() -> String {
    DEFAULT_VALIDATION_FREQUENCY.to_string()
}

/// A key of a Secret in the referring object's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyReference {
    /// Secret name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Key inside the Secret's data.
    #[serde(default = "default_credential_key")]
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

fn default_credential_key() -> String {
    DEFAULT_CREDENTIAL_KEY.to_string()
}

impl BackupStorageLocationSpec {
    /// The probe interval, or `None` when probing is disabled (`0`).
    pub fn validation_interval(&self) -> Result<Option<Duration>, DurationError> {
        let interval = parse_duration(&self.validation_frequency)?;
        Ok((!interval.is_zero()).then_some(interval))
    }
}

/// What the controller last found out about a location.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackupStorageLocationStatus {
    /// Available when the last probe succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<BackupStorageLocationPhase>,
    /// When the last probe ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_validation_time: Option<Time>,
    /// How long the last probe's requests took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub last_probe_latency_milliseconds: Option<i64>,
    /// The bytes of the repository's index files when the last probe
    /// listed them. Every mover agent holds the index they describe in
    /// memory, so stage pods plan with it: a large index leaves room for
    /// fewer volumes at once, and raises a stage pod's memory request when
    /// one volume would not fit beside it (docs/controller.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub index_bytes: Option<i64>,
    /// Why the location is Unavailable; never carries credentials.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub message: Option<String>,
    /// Conditions, keyed by type (`Available`; `UniqueDefault` on a
    /// location marked default).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` the status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The last scheduled maintenance (`spec.maintenance`), written by the
    /// controller replica that ran it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub maintenance: Option<MaintenanceStatus>,
}

/// How the last scheduled prune of a location's repository went.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MaintenanceStatus {
    /// Running, or how the last prune ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<MaintenanceResult>,
    /// When the last prune started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_start_time: Option<Time>,
    /// When it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_completion_time: Option<Time>,
    /// The location's `metadata.generation` the last prune ran for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The controller replica that ran it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub runner: Option<String>,
    /// What it did, or why it failed or deferred its deletions; never
    /// carries credentials.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub message: Option<String>,
    /// Bytes of the repository's packs when it started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub stored_bytes: Option<i64>,
    /// Bytes of them the snapshots reference.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub used_bytes: Option<i64>,
    /// Bytes deleted by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub reclaimed_bytes: Option<i64>,
    /// Packs deleted by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub deleted_packs: Option<i64>,
    /// Bytes of unneeded packs waiting for their safety margin (deleted by
    /// a later prune).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub waiting_bytes: Option<i64>,
}

/// Where a location's scheduled prune stands.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum MaintenanceResult {
    /// A replica is pruning now.
    Running,
    /// The prune finished; everything due was deleted.
    Succeeded,
    /// The prune planned and marked, but could not take the exclusive lock
    /// for its deletions (transfers held the repository): a later prune
    /// deletes them.
    Deferred,
    /// The prune failed (see the message); nothing referenced was deleted.
    Failed,
}

/// Whether a location can be used.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum BackupStorageLocationPhase {
    /// The last probe reached the bucket with the credentials.
    Available,
    /// The last probe failed, or the credentials are missing.
    Unavailable,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(yaml: &str) -> BackupStorageLocationSpec {
        serde_yaml::from_str(yaml).expect("valid spec")
    }

    #[test]
    fn defaults_fill_the_optional_fields() {
        let spec = spec("bucket: b\ncredential: {name: s3}\n");
        assert_eq!(spec.validation_frequency, DEFAULT_VALIDATION_FREQUENCY);
        assert_eq!(spec.credential.key, DEFAULT_CREDENTIAL_KEY);
        assert!(!spec.is_default);
        assert_eq!(
            spec.validation_interval(),
            Ok(Some(Duration::from_secs(60)))
        );
    }

    #[test]
    fn the_crd_checks_durations_with_the_pattern_the_parser_reads() {
        use kube::CustomResourceExt;
        let crd = serde_json::to_string(&BackupStorageLocation::crd()).expect("serialisable");
        assert!(crd.contains(crate::progress::DURATION_PATTERN), "{crd}");
    }

    #[test]
    fn zero_validation_frequency_disables_probing() {
        let spec = spec("bucket: b\ncredential: {name: s3}\nvalidationFrequency: '0'\n");
        assert_eq!(spec.validation_interval(), Ok(None));
    }

    #[test]
    fn the_default_flag_is_serialised_as_default() {
        let spec = spec("bucket: b\ncredential: {name: s3}\ndefault: true\n");
        assert!(spec.is_default);
        let json = serde_json::to_value(&spec).expect("serialisable");
        assert_eq!(json["default"], serde_json::Value::Bool(true));
    }
}
