//! Kubernetes Events on haulage's objects, for `kubectl describe` at 3 a.m.:
//! a backup claimed or adopted, a stage pod recreated or given up on, a
//! backup finished, a storage location turning Available or Unavailable.
//! Emitted on transitions only (kube-runtime's recorder folds repeats into
//! a series). A failure to publish is logged and never fails a reconcile:
//! the status is the record, events are the story.

use kube::Resource;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tracing::warn;

use crate::api::condition::bounded_message;

/// The `reportingController` of every event.
pub const REPORTING_CONTROLLER: &str = "haulage.dev/controller";

/// Publishes events as this replica.
#[derive(Clone)]
pub struct Events {
    recorder: Recorder,
}

impl Events {
    /// A publisher reporting as `identity` (the replica's pod name).
    pub fn new(client: kube::Client, identity: &str) -> Self {
        Events {
            recorder: Recorder::new(
                client,
                Reporter {
                    controller: REPORTING_CONTROLLER.to_string(),
                    instance: Some(identity.to_string()),
                },
            ),
        }
    }

    /// A `Normal` event on `object`.
    pub async fn normal<K>(&self, object: &K, reason: &str, action: &str, note: &str)
    where
        K: Resource<DynamicType = ()>,
    {
        self.publish(object, EventType::Normal, reason, action, note)
            .await;
    }

    /// A `Warning` event on `object`.
    pub async fn warning<K>(&self, object: &K, reason: &str, action: &str, note: &str)
    where
        K: Resource<DynamicType = ()>,
    {
        self.publish(object, EventType::Warning, reason, action, note)
            .await;
    }

    async fn publish<K>(&self, object: &K, type_: EventType, reason: &str, action: &str, note: &str)
    where
        K: Resource<DynamicType = ()>,
    {
        let event = Event {
            type_,
            reason: reason.to_string(),
            note: Some(bounded_message(note)),
            action: action.to_string(),
            secondary: None,
        };
        if let Err(error) = self.recorder.publish(&event, &object.object_ref(&())).await {
            warn!(
                %error,
                reason,
                object = object.meta().name.as_deref().unwrap_or_default(),
                "cannot publish an event (check the controller's RBAC for events); the status still says it"
            );
        }
    }
}
