//! What the unit tests of the decisions start from alike: a time and an
//! Available storage location.

use std::sync::Arc;

use haulage_api::{BackupStorageLocation, BackupStorageLocationPhase, BackupStorageLocationStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

/// The time the tests count from.
const T0: i64 = 1_800_000_000;

/// `seconds` after [`T0`].
pub(crate) fn at(seconds: i64) -> Time {
    Time(Timestamp::from_second(T0 + seconds).expect("in range"))
}

/// The BackupStorageLocation `name`, Available, the namespace's default
/// or not.
pub(crate) fn available_default(name: &str, is_default: bool) -> Arc<BackupStorageLocation> {
    let mut location = (*available(name)).clone();
    location.spec.is_default = is_default;
    Arc::new(location)
}

/// The BackupStorageLocation `name`, Available.
pub(crate) fn available(name: &str) -> Arc<BackupStorageLocation> {
    let mut location = BackupStorageLocation::test(name);
    location.status = Some(BackupStorageLocationStatus {
        phase: Some(BackupStorageLocationPhase::Available),
        ..BackupStorageLocationStatus::default()
    });
    Arc::new(location)
}
