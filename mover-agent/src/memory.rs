//! The agent's memory budget and how its volumes share it: how many move
//! at once, and the share each engine sizes its buffers from.
//!
//! In a stage pod the controller gives the budget (`HAULAGE_MEMORY_BUDGET`,
//! the container's memory request through the downward API) and the bytes
//! of the repository's index files its location's probe listed
//! (`HAULAGE_INDEX_BYTES`), and its admission counts on the same number of
//! volumes at once ([`haulage::api::transfer::AgentMemory`] of those two).
//! Run by hand, the agent takes its container's memory limit from its
//! cgroup and lists the index files itself.

use haulage::api::transfer::AgentMemory;
use haulage::engine::memory::EngineMemory;

/// A cgroup limit at or above this is no limit (cgroup v1 writes "no
/// limit" as the largest page-aligned number).
const UNLIMITED_BYTES: u64 = 1 << 50;

/// The budget without a flag and without a cgroup limit: a stage pod's
/// default memory request.
pub const DEFAULT_BUDGET_BYTES: u64 = haulage::reconcile::stage_pod::DEFAULT_MEMORY_REQUEST_BYTES;

/// `--memory-budget`: bytes, or a Kubernetes quantity (`128Mi`, `1Gi`).
pub fn parse_budget(text: &str) -> Result<u64, String> {
    haulage::plan::quantity::parse_quantity(text.trim())
        .map_err(|error| format!("{error} (bytes, or a quantity such as 128Mi)"))
        .and_then(|bytes| {
            if bytes == 0 {
                Err("must be more than 0 bytes".to_string())
            } else {
                Ok(bytes)
            }
        })
}

/// The memory limit of the cgroup this process runs in: cgroup v2's
/// `memory.max`, else cgroup v1's `memory.limit_in_bytes`; `None` without
/// one (or without a limit).
pub fn cgroup_memory_limit() -> Option<u64> {
    [
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ]
    .iter()
    .find_map(|path| parse_cgroup_limit(&std::fs::read_to_string(path).ok()?))
}

/// A cgroup memory limit file's content: a number of bytes, or `max` (or
/// a number too large to be one) for none.
fn parse_cgroup_limit(text: &str) -> Option<u64> {
    text.trim()
        .parse::<u64>()
        .ok()
        .filter(|bytes| *bytes < UNLIMITED_BYTES)
}

/// How an agent with `memory` moves `transfers` volumes: at once as many
/// as its budget holds beside the repository's index (or
/// `parallel_volumes` when given, the `--parallel-volumes` of someone
/// trying the agent by hand), and no more than it has; each engine gets an
/// equal share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VolumePlan {
    /// Volumes moved at once.
    pub at_once: usize,
    /// What each engine may hold.
    pub memory: EngineMemory,
}

impl VolumePlan {
    /// The plan for `transfers` volumes within `memory`.
    pub fn new(memory: AgentMemory, parallel_volumes: Option<usize>, transfers: usize) -> Self {
        let fits = memory.volumes_at_once() as usize;
        let at_once = parallel_volumes.unwrap_or(fits).min(transfers).max(1);
        VolumePlan {
            at_once,
            memory: EngineMemory::new(
                memory.volume_share_bytes(u32::try_from(at_once).unwrap_or(u32::MAX)),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use haulage::api::transfer::DEFAULT_VOLUME_SHARE_BYTES;

    const MIB: u64 = 1024 * 1024;

    #[test]
    fn cgroup_limits_are_read_and_no_limit_is_none() {
        assert_eq!(parse_cgroup_limit("268435456\n"), Some(256 * MIB));
        assert_eq!(parse_cgroup_limit("max\n"), None);
        assert_eq!(parse_cgroup_limit("9223372036854771712\n"), None);
        assert_eq!(parse_cgroup_limit(""), None);
    }

    #[test]
    fn budgets_are_bytes_or_quantities() {
        assert_eq!(parse_budget("134217728"), Ok(128 * MIB));
        assert_eq!(parse_budget("128Mi"), Ok(128 * MIB));
        assert!(parse_budget("0").is_err());
        assert!(parse_budget("lots").unwrap_err().contains("128Mi"));
    }

    #[test]
    fn a_stage_pod_of_128mi_moves_four_volumes_in_four_shares() {
        let plan = VolumePlan::new(AgentMemory::of_budget(128 * MIB), None, 10);
        assert_eq!(plan.at_once, 4);
        assert_eq!(plan.memory.bytes(), 23 * MIB);
        // Two claims: two at once, each with half.
        let plan = VolumePlan::new(AgentMemory::of_budget(128 * MIB), None, 2);
        assert_eq!((plan.at_once, plan.memory.bytes()), (2, 46 * MIB));
        // One claim: what the baseline leaves.
        let plan = VolumePlan::new(AgentMemory::of_budget(128 * MIB), None, 1);
        assert_eq!((plan.at_once, plan.memory.bytes()), (1, 92 * MIB));
        // By hand: one at a time.
        let plan = VolumePlan::new(AgentMemory::of_budget(128 * MIB), Some(1), 10);
        assert_eq!((plan.at_once, plan.memory.bytes()), (1, 92 * MIB));
        // A larger budget: at most a whole engine each.
        let plan = VolumePlan::new(AgentMemory::of_budget(512 * MIB), None, 1);
        assert_eq!(
            (plan.at_once, plan.memory.bytes()),
            (1, DEFAULT_VOLUME_SHARE_BYTES)
        );
    }

    #[test]
    fn a_large_index_leaves_fewer_volumes_at_once_in_the_same_budget() {
        // The index files of about half a million blobs.
        let memory = AgentMemory {
            budget_bytes: 128 * MIB,
            index_file_bytes: 21_250_000,
        };
        let plan = VolumePlan::new(memory, None, 10);
        assert_eq!(plan.at_once, 2);
        // 92 MiB beside the baseline, less the index's 26 MiB beyond it.
        assert_eq!(plan.memory.bytes() / MIB, 33);
        // Alone, a volume gets what the baseline and the index leave.
        let plan = VolumePlan::new(memory, None, 1);
        assert_eq!(plan.at_once, 1);
        assert!(plan.memory.bytes() < 92 * MIB, "{}", plan.memory.bytes());
    }
}
