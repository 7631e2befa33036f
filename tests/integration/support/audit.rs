//! The kube-apiserver's audit log, as the record of who asked the API server
//! for what: [`KubeCluster::start_audited`](super::kube::KubeCluster::start_audited)
//! starts the apiserver with [`POLICY`] (every request at level `Metadata`,
//! without the `RequestReceived` stage), and [`read`] turns the JSON lines
//! into one [`Request`] per request. Counting from the server's side sees
//! every request, whichever client library, retry or cache made it.

use std::collections::{BTreeMap, HashMap};
use std::ops::RangeBounds;
use std::path::Path;

use anyhow::Context;
use serde::Deserialize;

/// The audit policy: every request at level `Metadata` (user, verb, object
/// reference, response code; no bodies). `RequestReceived` is omitted, so a
/// short request is one `ResponseComplete` line and a watch is a
/// `ResponseStarted` line (and a `ResponseComplete` line once it ends).
pub const POLICY: &str = "apiVersion: audit.k8s.io/v1\n\
kind: Policy\n\
omitStages: [\"RequestReceived\"]\n\
rules:\n\
- level: Metadata\n";

/// The user name of a service account's token.
pub fn service_account(namespace: &str, name: &str) -> String {
    format!("system:serviceaccount:{namespace}:{name}")
}

/// Whether `user` is an agent's: the `haulage-agent` ServiceAccount of
/// whichever namespace its stage pod runs in.
pub fn is_agent(user: &str) -> bool {
    user.starts_with("system:serviceaccount:") && user.ends_with(":haulage-agent")
}

/// The requests of the users `user` accepts that were received within
/// `received` (`created..=finished`, `..created`, `created..`, `..`), in
/// the log's order.
pub fn select(
    requests: &[Request],
    user: impl Fn(&str) -> bool,
    received: impl RangeBounds<k8s_openapi::jiff::Timestamp>,
) -> Vec<&Request> {
    requests
        .iter()
        .filter(|request| user(&request.user) && received.contains(&request.received))
        .collect()
}

/// The objects of a stage pod's release (pods, RoleBindings, Roles,
/// Secrets: the credentials copies) that `user` asked to delete more than
/// once among `requests`, each with its count: `resource ns/name` →
/// deletes. A release decided once per stage pod leaves this empty.
pub fn deleted_more_than_once(requests: &[Request], user: &str) -> BTreeMap<String, usize> {
    let mut deletes: BTreeMap<String, usize> = BTreeMap::new();
    for request in requests.iter().filter(|request| {
        request.user == user
            && request.verb == "delete"
            && ["pods", "rolebindings", "roles", "secrets"].contains(&request.resource.as_str())
    }) {
        let object = format!(
            "{} {}/{}",
            request.resource,
            request.namespace.as_deref().unwrap_or_default(),
            request.name.as_deref().unwrap_or_default()
        );
        *deletes.entry(object).or_default() += 1;
    }
    deletes.retain(|_, count| *count > 1);
    deletes
}

/// One request as the API server saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// `user.username`.
    pub user: String,
    /// get, list, watch, create, update, patch, delete, ...
    pub verb: String,
    /// `resource` or `resource/subresource`; for a non-resource request
    /// (`/version`, `/apis`) its path.
    pub resource: String,
    /// The object's namespace, if any.
    pub namespace: Option<String>,
    /// The object's name, if any.
    pub name: Option<String>,
    /// The response code, when the request completed.
    pub code: Option<i32>,
    /// When the request was received.
    pub received: k8s_openapi::jiff::Timestamp,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Event {
    #[serde(rename = "auditID")]
    audit_id: String,
    stage: String,
    verb: String,
    #[serde(rename = "requestURI")]
    request_uri: String,
    user: User,
    #[serde(default)]
    object_ref: Option<ObjectRef>,
    #[serde(default)]
    response_status: Option<ResponseStatus>,
    request_received_timestamp: String,
}

#[derive(Deserialize)]
struct User {
    #[serde(default)]
    username: String,
}

#[derive(Deserialize)]
struct ObjectRef {
    #[serde(default)]
    resource: Option<String>,
    #[serde(default)]
    subresource: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    name: Option<String>,
}

#[derive(Deserialize)]
struct ResponseStatus {
    #[serde(default)]
    code: Option<i32>,
}

/// Parse an audit log's JSON lines into one [`Request`] per audit ID (a
/// watch's `ResponseStarted` and `ResponseComplete` are one request), in
/// the order the requests were first logged.
pub fn parse(text: &str) -> anyhow::Result<Vec<Request>> {
    let mut requests: Vec<Request> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    for (number, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let event: Event = serde_json::from_str(line)
            .with_context(|| format!("audit log line {}: {line}", number + 1))?;
        let code = event.response_status.and_then(|status| status.code);
        if let Some(&position) = index.get(&event.audit_id) {
            if event.stage == "ResponseComplete" {
                requests[position].code = code;
            }
            continue;
        }
        let (resource, namespace, name) = match event.object_ref {
            Some(object) if object.resource.is_some() => {
                let resource = object.resource.unwrap_or_default();
                let resource = match object.subresource {
                    Some(subresource) => format!("{resource}/{subresource}"),
                    None => resource,
                };
                (resource, object.namespace, object.name)
            }
            _ => {
                let path = event.request_uri.split('?').next().unwrap_or_default();
                (path.to_string(), None, None)
            }
        };
        let received = event
            .request_received_timestamp
            .parse()
            .with_context(|| format!("audit log line {}: timestamp", number + 1))?;
        index.insert(event.audit_id, requests.len());
        requests.push(Request {
            user: event.user.username,
            verb: event.verb,
            resource,
            namespace,
            name,
            code,
            received,
        });
    }
    Ok(requests)
}

/// Read and [`parse`] the audit log at `path`.
pub fn read(path: &Path) -> anyhow::Result<Vec<Request>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("read audit log {}", path.display()))?;
    parse(&text)
}

/// Requests counted by (verb, resource).
pub fn count_by_verb_and_resource<'a>(
    requests: impl IntoIterator<Item = &'a Request>,
) -> BTreeMap<(String, String), usize> {
    let mut counts = BTreeMap::new();
    for request in requests {
        *counts
            .entry((request.verb.clone(), request.resource.clone()))
            .or_insert(0) += 1;
    }
    counts
}

/// A table of `counts` (verb, resource, count, count per `per`), largest
/// first, with a total line.
pub fn table(counts: &BTreeMap<(String, String), usize>, per: usize, per_name: &str) -> String {
    let mut rows: Vec<(&(String, String), &usize)> = counts.iter().collect();
    rows.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    let per = per.max(1) as f64;
    let mut text =
        format!("| verb | resource | requests | per {per_name} |\n| --- | --- | --- | --- |\n");
    for ((verb, resource), count) in rows {
        text.push_str(&format!(
            "| {verb} | {resource} | {count} | {:.2} |\n",
            *count as f64 / per
        ));
    }
    let total: usize = counts.values().sum();
    text.push_str(&format!(
        "| all | | {total} | {:.2} |\n",
        total as f64 / per
    ));
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_logged_when_it_started_and_when_it_ended_is_one_request() {
        let log = r#"{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"a1","stage":"ResponseStarted","requestURI":"/api/v1/persistentvolumeclaims?watch=true","verb":"watch","user":{"username":"system:serviceaccount:haulage-system:haulage-controller"},"objectRef":{"resource":"persistentvolumeclaims","apiVersion":"v1"},"responseStatus":{"metadata":{},"code":200},"requestReceivedTimestamp":"2026-11-29T14:00:00.000000Z","stageTimestamp":"2026-11-29T14:00:00.001000Z"}
{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"a2","stage":"ResponseComplete","requestURI":"/apis/haulage.dev/v1alpha1/namespaces/shop/volumetransfers/x/status","verb":"patch","user":{"username":"system:serviceaccount:shop:haulage-agent"},"objectRef":{"resource":"volumetransfers","namespace":"shop","name":"x","apiGroup":"haulage.dev","apiVersion":"v1alpha1","subresource":"status"},"responseStatus":{"metadata":{},"code":200},"requestReceivedTimestamp":"2026-11-29T14:00:01.000000Z","stageTimestamp":"2026-11-29T14:00:01.002000Z"}
{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"a3","stage":"ResponseComplete","requestURI":"/version?timeout=5s","verb":"get","user":{"username":"haulage-admin"},"responseStatus":{"metadata":{},"code":200},"requestReceivedTimestamp":"2026-11-29T14:00:02.000000Z","stageTimestamp":"2026-11-29T14:00:02.001000Z"}
{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"a1","stage":"ResponseComplete","requestURI":"/api/v1/persistentvolumeclaims?watch=true","verb":"watch","user":{"username":"system:serviceaccount:haulage-system:haulage-controller"},"objectRef":{"resource":"persistentvolumeclaims","apiVersion":"v1"},"responseStatus":{"metadata":{},"code":200},"requestReceivedTimestamp":"2026-11-29T14:00:00.000000Z","stageTimestamp":"2026-11-29T14:05:00.000000Z"}
"#;
        let requests = parse(log).expect("parse");
        assert_eq!(requests.len(), 3);
        assert_eq!(
            requests[0].user,
            service_account("haulage-system", "haulage-controller")
        );
        assert_eq!(
            (requests[0].verb.as_str(), requests[0].resource.as_str()),
            ("watch", "persistentvolumeclaims")
        );
        assert_eq!(requests[1].resource, "volumetransfers/status");
        assert_eq!(requests[1].namespace.as_deref(), Some("shop"));
        assert_eq!(requests[2].resource, "/version");
        let counts = count_by_verb_and_resource(&requests);
        assert_eq!(
            counts.get(&("patch".to_string(), "volumetransfers/status".to_string())),
            Some(&1)
        );
    }
}
