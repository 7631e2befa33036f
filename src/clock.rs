//! The clock: the one place the controller, the agent and the CLI read
//! the time. The pure crates (`api`, `plan`, `repo`, `reconcile`) never
//! do; every decision takes the time as an argument, read here.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use k8s_openapi::jiff::Timestamp;

/// Now, as the API's `Time` (seconds precision on the wire).
pub fn now() -> Time {
    Time(Timestamp::now())
}

/// Now, as the API's `MicroTime` (Leases).
pub fn now_micro() -> MicroTime {
    MicroTime(Timestamp::now())
}

/// A wall-clock time, as the API's `Time` (the epoch when out of range).
pub fn time_of(at: std::time::SystemTime) -> Time {
    Time(Timestamp::try_from(at).unwrap_or(Timestamp::UNIX_EPOCH))
}

/// Now, as a timestamp.
pub fn timestamp() -> Timestamp {
    Timestamp::now()
}
