//! Quiescing the source for the cutover pass, decided from plain objects:
//! which pods use the migrated claims ([`pods_using`]), which workloads
//! run them ([`workloads_of`]: a Deployment through its ReplicaSet, a
//! StatefulSet, a ReplicaSet no Deployment owns; a DaemonSet, a bare pod or
//! any other owner is refused by name), the merge patches that scale them
//! to zero recording their replica counts ([`quiesce_patch`]) and that
//! give the counts back ([`unquiesce_patch`]), and the claims a
//! ReadWriteOncePod pod holds ([`single_pod_claims_in_use`]). The CLI
//! lists and patches; nothing here does I/O.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::ResourceExt;
use serde_json::json;

use crate::api::labels::{MANAGED_BY, MANAGED_BY_LABEL};

/// Annotation on a quiesced workload: its replica count before
/// `haulage migrate --quiesce` scaled it to zero.
pub const QUIESCED_REPLICAS_ANNOTATION: &str = "haulage.dev/quiesced-replicas";
/// Annotation on a quiesced workload: the migration that quiesced it.
pub const QUIESCED_BY_ANNOTATION: &str = "haulage.dev/quiesced-by";
/// Annotation on a quiesced workload: when it was scaled to zero (RFC
/// 3339), the start of the downtime window.
pub const QUIESCED_AT_ANNOTATION: &str = "haulage.dev/quiesced-at";

/// A claim, `(namespace, name)`.
pub type ClaimKey = (String, String);

/// A workload kind `haulage migrate --quiesce` scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum WorkloadKind {
    /// `apps/v1` Deployment (its ReplicaSets follow it).
    Deployment,
    /// `apps/v1` StatefulSet.
    StatefulSet,
    /// `apps/v1` ReplicaSet that no Deployment owns.
    ReplicaSet,
}

impl WorkloadKind {
    /// The kind's name, as Kubernetes spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkloadKind::Deployment => "Deployment",
            WorkloadKind::StatefulSet => "StatefulSet",
            WorkloadKind::ReplicaSet => "ReplicaSet",
        }
    }
}

/// A workload to scale.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Workload {
    /// Its kind.
    pub kind: WorkloadKind,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

impl std::fmt::Display for Workload {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            formatter,
            "{} {}/{}",
            self.kind.as_str(),
            self.namespace,
            self.name
        )
    }
}

/// A workload's state as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkloadState {
    /// Which workload.
    pub workload: Workload,
    /// `spec.replicas` (Kubernetes' default of 1 when absent).
    pub replicas: i32,
    /// Its annotations.
    pub annotations: BTreeMap<String, String>,
}

impl WorkloadState {
    /// The state of a workload from its metadata and `spec.replicas`.
    pub fn new(kind: WorkloadKind, metadata: &ObjectMeta, replicas: Option<i32>) -> Self {
        WorkloadState {
            workload: Workload {
                kind,
                namespace: metadata.namespace.clone().unwrap_or_default(),
                name: metadata.name.clone().unwrap_or_default(),
            },
            replicas: replicas.unwrap_or(1),
            annotations: metadata.annotations.clone().unwrap_or_default(),
        }
    }

    /// The replica count recorded when it was quiesced, if it is.
    pub fn recorded_replicas(&self) -> Option<i32> {
        self.annotations
            .get(QUIESCED_REPLICAS_ANNOTATION)
            .and_then(|value| value.trim().parse().ok())
    }

    /// The migration that quiesced it, if one did.
    pub fn quiesced_by(&self) -> Option<&str> {
        self.annotations
            .get(QUIESCED_BY_ANNOTATION)
            .map(String::as_str)
    }
}

/// Whether a pod holds its volumes: bound to a node and not finished.
/// Haulage's own stage pods are left out (they are not the workload).
fn is_live_workload_pod(pod: &Pod) -> bool {
    let finished = pod
        .status
        .as_ref()
        .and_then(|status| status.phase.as_deref())
        .is_some_and(|phase| phase == "Succeeded" || phase == "Failed");
    let ours = pod.labels().get(MANAGED_BY_LABEL).map(String::as_str) == Some(MANAGED_BY);
    !finished && !ours
}

/// The claims among `claims` that `pod` mounts.
fn claims_of(pod: &Pod, claims: &BTreeSet<ClaimKey>) -> Vec<String> {
    let namespace = pod.namespace().unwrap_or_default();
    let mut mounted: Vec<String> = pod
        .spec
        .iter()
        .flat_map(|spec| spec.volumes.iter().flatten())
        .filter_map(|volume| volume.persistent_volume_claim.as_ref())
        .map(|source| source.claim_name.clone())
        .filter(|claim| claims.contains(&(namespace.clone(), claim.clone())))
        .collect();
    mounted.sort();
    mounted.dedup();
    mounted
}

/// The live pods (not finished, not haulage's) that mount one of
/// `claims`, each with the claims it mounts, sorted by (namespace, name).
pub fn pods_using<'a>(claims: &BTreeSet<ClaimKey>, pods: &'a [Pod]) -> Vec<(&'a Pod, Vec<String>)> {
    let mut using: Vec<(&Pod, Vec<String>)> = pods
        .iter()
        .filter(|pod| is_live_workload_pod(pod))
        .map(|pod| (pod, claims_of(pod, claims)))
        .filter(|(_, mounted)| !mounted.is_empty())
        .collect();
    using.sort_by_key(|(pod, _)| (pod.namespace(), pod.name_any()));
    using
}

/// The ReadWriteOncePod claims among `claims` that a live pod mounts:
/// (claim, pod), each `namespace/name`. They can move only once that pod
/// is gone (`--quiesce`).
pub fn single_pod_claims_in_use(
    claims: &[&PersistentVolumeClaim],
    pods: &[Pod],
) -> Vec<(String, String)> {
    let single_pod: BTreeSet<ClaimKey> = claims
        .iter()
        .filter(|claim| {
            claim
                .spec
                .as_ref()
                .and_then(|spec| spec.access_modes.as_ref())
                .is_some_and(|modes| modes.iter().any(|mode| mode == "ReadWriteOncePod"))
        })
        .map(|claim| (claim.namespace().unwrap_or_default(), claim.name_any()))
        .collect();
    pods_using(&single_pod, pods)
        .into_iter()
        .flat_map(|(pod, mounted)| {
            let namespace = pod.namespace().unwrap_or_default();
            let pod_name = format!("{namespace}/{}", pod.name_any());
            mounted
                .into_iter()
                .map(move |claim| (format!("{namespace}/{claim}"), pod_name.clone()))
        })
        .collect()
}

fn controller_of(metadata: &ObjectMeta) -> Option<&OwnerReference> {
    metadata
        .owner_references
        .iter()
        .flatten()
        .find(|owner| owner.controller == Some(true))
}

/// The workloads that run the pods using `claims`, or every reason some
/// cannot be scaled (each naming the object, the pod and its claims).
/// A pod of a ReplicaSet is its Deployment's when a Deployment owns the
/// ReplicaSet (`replica_sets` are those of the pods' namespaces).
pub fn workloads_of(
    claims: &BTreeSet<ClaimKey>,
    pods: &[Pod],
    replica_sets: &[ReplicaSet],
) -> Result<BTreeSet<Workload>, Vec<String>> {
    let mut workloads = BTreeSet::new();
    let mut refusals = Vec::new();
    for (pod, mounted) in pods_using(claims, pods) {
        let namespace = pod.namespace().unwrap_or_default();
        let pod_name = pod.name_any();
        let uses = format!(
            "pod {namespace}/{pod_name} (mounting {})",
            mounted.join(", ")
        );
        let workload = |kind, name: &str| Workload {
            kind,
            namespace: namespace.clone(),
            name: name.to_string(),
        };
        match controller_of(&pod.metadata) {
            None => refusals.push(format!(
                "{uses} has no controller, so it cannot be scaled to zero: delete it yourself before the cutover, or run it from a Deployment or StatefulSet"
            )),
            Some(owner) if owner.kind == "StatefulSet" => {
                workloads.insert(workload(WorkloadKind::StatefulSet, &owner.name));
            }
            Some(owner) if owner.kind == "ReplicaSet" => {
                let replica_set = replica_sets.iter().find(|set| {
                    set.namespace().as_deref() == Some(namespace.as_str())
                        && set.name_any() == owner.name
                });
                let deployment = replica_set
                    .and_then(|set| controller_of(&set.metadata))
                    .filter(|owner| owner.kind == "Deployment");
                match (replica_set, deployment) {
                    (_, Some(deployment)) => {
                        workloads.insert(workload(WorkloadKind::Deployment, &deployment.name));
                    }
                    (Some(set), None) if controller_of(&set.metadata).is_some() => {
                        let other = controller_of(&set.metadata).map_or("", |o| o.kind.as_str());
                        refusals.push(format!(
                            "{uses} belongs to ReplicaSet {namespace}/{}, which a {other} controls: haulage scales Deployments, StatefulSets and ReplicaSets only; stop it yourself before the cutover",
                            owner.name
                        ));
                    }
                    (Some(_), None) => {
                        workloads.insert(workload(WorkloadKind::ReplicaSet, &owner.name));
                    }
                    (None, _) => refusals.push(format!(
                        "{uses} belongs to ReplicaSet {namespace}/{}, which is not found: run again once it is listed, or stop the pod yourself",
                        owner.name
                    )),
                }
            }
            Some(owner) if owner.kind == "DaemonSet" => refusals.push(format!(
                "{uses} belongs to DaemonSet {namespace}/{}, which cannot be scaled to zero: remove it (or its node selector's nodes) yourself before the cutover",
                owner.name
            )),
            Some(owner) => refusals.push(format!(
                "{uses} belongs to {} {namespace}/{}, which haulage cannot scale: stop it yourself before the cutover",
                owner.kind, owner.name
            )),
        }
    }
    if refusals.is_empty() {
        Ok(workloads)
    } else {
        Err(refusals)
    }
}

/// The merge patch that quiesces `state` for migration `migration` at
/// `now` (RFC 3339), or `None` when nothing is to change. The replica
/// count is recorded only once: a workload already quiesced (a resumed
/// migration) keeps the count it had before, never the zero it has now.
pub fn quiesce_patch(
    state: &WorkloadState,
    migration: &str,
    now: &str,
) -> Option<serde_json::Value> {
    if state.recorded_replicas().is_some() {
        return (state.replicas != 0).then(|| json!({"spec": {"replicas": 0}}));
    }
    Some(json!({
        "metadata": {"annotations": {
            QUIESCED_REPLICAS_ANNOTATION: state.replicas.to_string(),
            QUIESCED_BY_ANNOTATION: migration,
            QUIESCED_AT_ANNOTATION: now,
        }},
        "spec": {"replicas": 0},
    }))
}

/// The merge patch that gives `state` its recorded replica count back
/// and removes the annotations, or `None` when it was not quiesced.
pub fn unquiesce_patch(state: &WorkloadState) -> Option<serde_json::Value> {
    let replicas = state.recorded_replicas()?;
    Some(json!({
        "metadata": {"annotations": {
            QUIESCED_REPLICAS_ANNOTATION: null,
            QUIESCED_BY_ANNOTATION: null,
            QUIESCED_AT_ANNOTATION: null,
        }},
        "spec": {"replicas": replicas},
    }))
}

/// The earliest `quiesced-at` among `states` quiesced by `migration`: the
/// start of the downtime window.
pub fn quiesced_since(states: &[WorkloadState], migration: &str) -> Option<String> {
    states
        .iter()
        .filter(|state| state.quiesced_by() == Some(migration))
        .filter_map(|state| state.annotations.get(QUIESCED_AT_ANNOTATION).cloned())
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(namespace: &str, name: &str, claims: &[&str], owner: Option<(&str, &str)>) -> Pod {
        let volumes: Vec<serde_json::Value> = claims
            .iter()
            .map(|claim| json!({"name": claim, "persistentVolumeClaim": {"claimName": claim}}))
            .collect();
        let owners: Vec<serde_json::Value> = owner
            .iter()
            .map(|(kind, name)| {
                json!({"apiVersion": "apps/v1", "kind": kind, "name": name, "uid": "u", "controller": true})
            })
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": namespace, "ownerReferences": owners},
            "spec": {"nodeName": "node-a", "containers": [{"name": "app"}], "volumes": volumes},
            "status": {"phase": "Running"},
        }))
        .expect("pod")
    }

    fn replica_set(namespace: &str, name: &str, deployment: Option<&str>) -> ReplicaSet {
        let owners: Vec<serde_json::Value> = deployment
            .iter()
            .map(|name| json!({"apiVersion": "apps/v1", "kind": "Deployment", "name": name, "uid": "d", "controller": true}))
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": namespace, "ownerReferences": owners},
        }))
        .expect("replica set")
    }

    fn claims(keys: &[(&str, &str)]) -> BTreeSet<ClaimKey> {
        keys.iter()
            .map(|(namespace, name)| (namespace.to_string(), name.to_string()))
            .collect()
    }

    #[test]
    fn a_deployments_pods_quiesce_the_deployment_and_a_statefulsets_the_statefulset() {
        let pods = [
            pod(
                "shop",
                "web-7d9-a",
                &["uploads"],
                Some(("ReplicaSet", "web-7d9")),
            ),
            pod(
                "shop",
                "web-7d9-b",
                &["uploads"],
                Some(("ReplicaSet", "web-7d9")),
            ),
            pod("shop", "db-0", &["db"], Some(("StatefulSet", "db"))),
            pod("shop", "batch", &["scratch"], None),
            pod("web", "cache-1", &["cache"], Some(("ReplicaSet", "cache"))),
        ];
        let sets = [
            replica_set("shop", "web-7d9", Some("web")),
            replica_set("web", "cache", None),
        ];
        let workloads = workloads_of(
            &claims(&[("shop", "uploads"), ("shop", "db"), ("web", "cache")]),
            &pods,
            &sets,
        )
        .expect("all scalable");
        let names: Vec<String> = workloads.iter().map(ToString::to_string).collect();
        assert_eq!(
            names,
            [
                "Deployment shop/web",
                "StatefulSet shop/db",
                "ReplicaSet web/cache"
            ],
            "the unselected claim's bare pod is not looked at"
        );
    }

    #[test]
    fn a_daemonset_a_bare_pod_and_a_job_are_refused_by_name() {
        let pods = [
            pod("shop", "agent-x", &["db"], Some(("DaemonSet", "agent"))),
            pod("shop", "debug", &["db"], None),
            pod("shop", "import-1", &["db"], Some(("Job", "import"))),
            pod("shop", "db-0", &["db"], Some(("StatefulSet", "db"))),
        ];
        let refusals =
            workloads_of(&claims(&[("shop", "db")]), &pods, &[]).expect_err("not scalable");
        assert_eq!(refusals.len(), 3, "{refusals:#?}");
        assert!(
            refusals[0].contains("DaemonSet shop/agent"),
            "{}",
            refusals[0]
        );
        assert!(refusals[0].contains("pod shop/agent-x (mounting db)"));
        assert!(refusals[1].contains("pod shop/debug") && refusals[1].contains("no controller"));
        assert!(refusals[2].contains("Job shop/import"), "{}", refusals[2]);
    }

    #[test]
    fn finished_pods_and_haulages_stage_pods_do_not_use_a_claim() {
        let mut done = pod("shop", "migrate-job", &["db"], None);
        done.status.as_mut().expect("status").phase = Some("Succeeded".to_string());
        let mut stage = pod("shop", "haulage-backup-x", &["db"], None);
        stage
            .labels_mut()
            .insert(MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string());
        let pods = [done, stage];
        assert!(pods_using(&claims(&[("shop", "db")]), &pods).is_empty());
        assert_eq!(
            workloads_of(&claims(&[("shop", "db")]), &pods, &[]),
            Ok(BTreeSet::new())
        );
    }

    #[test]
    fn single_pod_claims_in_use_name_the_claim_and_the_pod() {
        let rwop: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": "ledger", "namespace": "shop"},
            "spec": {"accessModes": ["ReadWriteOncePod"]},
        }))
        .expect("claim");
        let rwo: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": "db", "namespace": "shop"},
            "spec": {"accessModes": ["ReadWriteOnce"]},
        }))
        .expect("claim");
        let pods = [
            pod(
                "shop",
                "ledger-0",
                &["ledger"],
                Some(("StatefulSet", "ledger")),
            ),
            pod("shop", "db-0", &["db"], Some(("StatefulSet", "db"))),
        ];
        assert_eq!(
            single_pod_claims_in_use(&[&rwop, &rwo], &pods),
            [("shop/ledger".to_string(), "shop/ledger-0".to_string())]
        );
    }

    fn state(replicas: Option<i32>, annotations: &[(&str, &str)]) -> WorkloadState {
        let metadata = ObjectMeta {
            name: Some("web".to_string()),
            namespace: Some("shop".to_string()),
            annotations: Some(
                annotations
                    .iter()
                    .map(|(key, value)| (key.to_string(), value.to_string()))
                    .collect(),
            ),
            ..ObjectMeta::default()
        };
        WorkloadState::new(WorkloadKind::Deployment, &metadata, replicas)
    }

    #[test]
    fn quiescing_records_the_replica_count_once_and_unquiescing_gives_it_back() {
        let running = state(Some(3), &[]);
        let patch = quiesce_patch(&running, "move", "2026-12-01T10:00:00Z").expect("a change");
        assert_eq!(patch["spec"]["replicas"], 0);
        assert_eq!(
            patch["metadata"]["annotations"][QUIESCED_REPLICAS_ANNOTATION],
            "3"
        );
        assert_eq!(
            patch["metadata"]["annotations"][QUIESCED_BY_ANNOTATION],
            "move"
        );

        // Resumed: already quiesced, the recorded 3 is not replaced by 0.
        let quiesced = state(
            Some(0),
            &[
                (QUIESCED_REPLICAS_ANNOTATION, "3"),
                (QUIESCED_BY_ANNOTATION, "move"),
            ],
        );
        assert_eq!(quiesce_patch(&quiesced, "move", "later"), None);
        // Scaled up again by someone meanwhile: back to zero, count kept.
        let scaled_up = state(Some(2), &[(QUIESCED_REPLICAS_ANNOTATION, "3")]);
        assert_eq!(
            quiesce_patch(&scaled_up, "move", "later"),
            Some(json!({"spec": {"replicas": 0}}))
        );

        let back = unquiesce_patch(&quiesced).expect("quiesced");
        assert_eq!(back["spec"]["replicas"], 3);
        assert!(back["metadata"]["annotations"][QUIESCED_REPLICAS_ANNOTATION].is_null());
        assert_eq!(unquiesce_patch(&running), None, "never quiesced");
    }

    #[test]
    fn an_absent_replica_count_is_kubernetes_default_of_one() {
        let patch = quiesce_patch(&state(None, &[]), "move", "now").expect("a change");
        assert_eq!(
            patch["metadata"]["annotations"][QUIESCED_REPLICAS_ANNOTATION],
            "1"
        );
    }

    #[test]
    fn the_downtime_starts_at_the_earliest_quiesce_of_this_migration() {
        let states = [
            state(
                Some(0),
                &[
                    (QUIESCED_BY_ANNOTATION, "move"),
                    (QUIESCED_AT_ANNOTATION, "2026-12-01T10:00:05Z"),
                ],
            ),
            state(
                Some(0),
                &[
                    (QUIESCED_BY_ANNOTATION, "move"),
                    (QUIESCED_AT_ANNOTATION, "2026-12-01T10:00:01Z"),
                ],
            ),
            state(
                Some(0),
                &[
                    (QUIESCED_BY_ANNOTATION, "other"),
                    (QUIESCED_AT_ANNOTATION, "2026-12-01T09:00:00Z"),
                ],
            ),
        ];
        assert_eq!(
            quiesced_since(&states, "move").as_deref(),
            Some("2026-12-01T10:00:01Z")
        );
    }
}
