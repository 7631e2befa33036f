//! What `haulage describe`, `haulage status` and `haulage migrate` read
//! alike from a VolumeBackup and a VolumeRestore, the two kinds that own
//! VolumeTransfers: the phase as shown, whether it is finished, its
//! location, message, progress and volume counts, how each of its volumes
//! ended, and the VolumeTransfers it owns.

use kube::api::ListParams;
use kube::{Api, ResourceExt};

use crate::api::backup::{VolumeCounts, VolumeResult};
use crate::api::labels::OWNER_UID_LABEL;
use crate::api::restore::RestoreResult;
use crate::api::{
    Progress, VolumeBackup, VolumeBackupPhase, VolumeRestore, VolumeRestorePhase, VolumeTransfer,
    VolumeTransferPhase,
};
use crate::cli::cluster::Namespaced;

/// A VolumeBackup or a VolumeRestore, as the CLI shows and follows it.
pub trait TransferOwner: Namespaced {
    /// Its phase.
    type Phase: Copy + std::fmt::Debug;
    /// What it is called in a line of progress: `backup` or `restore`.
    const NOUN: &'static str;
    /// Its phase, once a controller replica set one.
    fn phase(&self) -> Option<Self::Phase>;
    /// Whether nothing more happens in `phase`.
    fn is_final(phase: Self::Phase) -> bool;
    /// Whether `phase` is before the work starts (new, or waiting for its
    /// storage location).
    fn is_queued(phase: Self::Phase) -> bool;
    /// Its overall progress, once transfers report.
    fn progress(&self) -> Option<&Progress>;
    /// The BackupStorageLocation it names (`None`: the default one).
    fn storage_location(&self) -> Option<&str>;
    /// Its status message.
    fn message(&self) -> Option<&str>;
    /// Its volumes counted by phase, once planned.
    fn volumes(&self) -> Option<&VolumeCounts>;

    /// Whether nothing more happens to it.
    fn is_finished(&self) -> bool {
        self.phase().is_some_and(Self::is_final)
    }

    /// The phase as shown (`New` before a replica claimed it).
    fn shown_phase(&self) -> String {
        self.phase()
            .map_or_else(|| "New".to_string(), |phase| format!("{phase:?}"))
    }
}

/// A volume's entry in a backup's or a restore's `status.results`.
pub trait VolumeOutcome {
    /// The volume's namespace, claim, phase and message.
    fn outcome(&self) -> (&str, &str, VolumeTransferPhase, Option<&str>);
}

/// [`TransferOwner`] for `$kind` and [`VolumeOutcome`] for its `$result`:
/// both kinds name their location, their status's fields and their
/// results' fields alike, and both phases begin with `New` and
/// `WaitingForStorage`.
macro_rules! transfer_owner {
    ($kind:ty, $phase:ident, $result:ty, $noun:literal) => {
        impl TransferOwner for $kind {
            type Phase = $phase;
            const NOUN: &'static str = $noun;
            fn phase(&self) -> Option<$phase> {
                self.status.as_ref()?.phase
            }
            fn is_final(phase: $phase) -> bool {
                phase.is_final()
            }
            fn is_queued(phase: $phase) -> bool {
                matches!(phase, $phase::New | $phase::WaitingForStorage)
            }
            fn progress(&self) -> Option<&Progress> {
                self.status.as_ref()?.progress.as_ref()
            }
            fn storage_location(&self) -> Option<&str> {
                self.spec.storage_location.as_deref()
            }
            fn message(&self) -> Option<&str> {
                self.status.as_ref()?.message.as_deref()
            }
            fn volumes(&self) -> Option<&VolumeCounts> {
                self.status.as_ref()?.volumes.as_ref()
            }
        }

        impl VolumeOutcome for $result {
            fn outcome(&self) -> (&str, &str, VolumeTransferPhase, Option<&str>) {
                (
                    &self.namespace,
                    &self.pvc,
                    self.phase,
                    self.message.as_deref(),
                )
            }
        }
    };
}

transfer_owner!(VolumeBackup, VolumeBackupPhase, VolumeResult, "backup");
transfer_owner!(VolumeRestore, VolumeRestorePhase, RestoreResult, "restore");

/// The VolumeTransfers `owner` owns (labelled with its uid); none while it
/// has no uid.
pub async fn owned_transfers(
    transfers: &Api<VolumeTransfer>,
    owner: &impl ResourceExt,
) -> kube::Result<Vec<VolumeTransfer>> {
    let Some(uid) = owner.uid() else {
        return Ok(Vec::new());
    };
    Ok(transfers
        .list(&ListParams::default().labels(&format!("{OWNER_UID_LABEL}={uid}")))
        .await?
        .items)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owner_is_new_until_a_replica_sets_a_phase_and_finished_in_a_final_one() {
        let mut backup = VolumeBackup::test("nightly");
        assert_eq!(backup.shown_phase(), "New");
        assert!(!backup.is_finished());
        backup.status = Some(crate::api::VolumeBackupStatus {
            phase: Some(VolumeBackupPhase::PartiallyFailed),
            ..Default::default()
        });
        assert_eq!(backup.shown_phase(), "PartiallyFailed");
        assert!(backup.is_finished());
        let mut restore = VolumeRestore::test("move");
        restore.status = Some(crate::api::VolumeRestoreStatus {
            phase: Some(VolumeRestorePhase::InProgress),
            ..Default::default()
        });
        assert_eq!(restore.shown_phase(), "InProgress");
        assert!(!restore.is_finished());
        assert!(VolumeBackup::is_queued(
            VolumeBackupPhase::WaitingForStorage
        ));
        assert!(!VolumeBackup::is_queued(VolumeBackupPhase::Planning));
        assert!(VolumeRestore::is_queued(VolumeRestorePhase::New));
        assert!(!VolumeRestore::is_queued(VolumeRestorePhase::Selecting));
    }
}
