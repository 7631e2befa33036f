//! One wrapper for the stores that act before each request of the store
//! they wrap and then pass it on unchanged: [`Layered`] over a [`Layer`].
//!
//! The request cap and the upload rate limit ([`super::limits`]) are layers:
//! each says what it does before a request (take a permit, charge the bytes
//! of a `put`) and [`Layered`] forwards every method of [`ObjectStore`], so
//! no wrapper repeats the forwarding. The retry wrapper is not a layer: it
//! runs a request again, which a layer cannot.

use std::fmt;
use std::ops::Range;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use super::{DynStore, ObjectMeta, ObjectStore, PutMode, StoreError, SweepReport};

/// A request as a [`Layer`] sees it before it is passed on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request<'a> {
    /// [`ObjectStore::put`] of `bytes` bytes.
    Put { key: &'a str, bytes: u64 },
    /// [`ObjectStore::get`] or [`ObjectStore::get_range_into`].
    Get {
        key: &'a str,
        range: Option<Range<u64>>,
    },
    /// [`ObjectStore::head`].
    Head { key: &'a str },
    /// [`ObjectStore::list`].
    List { prefix: &'a str },
    /// [`ObjectStore::delete`].
    Delete { key: &'a str },
    /// [`ObjectStore::sweep_incomplete_uploads`].
    Sweep,
}

/// What a [`Layered`] store does before each request it passes on.
/// [`ObjectStore::location`] and [`ObjectStore::wait_for_cleanup`] pass
/// through without it.
#[async_trait]
pub trait Layer: Send + Sync + fmt::Debug {
    /// Held while the request runs and dropped when it ends (a permit).
    type Held: Send;

    /// Act on `request` before it goes to the wrapped store; the request
    /// waits until this returns.
    async fn before(&self, request: Request<'_>) -> Self::Held;
}

/// An [`ObjectStore`] that runs its [`Layer`] before each request and
/// then passes the request to the store it wraps.
#[derive(Debug)]
pub struct Layered<L> {
    inner: DynStore,
    layer: L,
}

impl<L: Layer> Layered<L> {
    /// `inner` behind `layer`.
    pub fn wrap(inner: DynStore, layer: L) -> Self {
        Layered { inner, layer }
    }

    /// The layer, for what it counted or enforces.
    pub fn layer(&self) -> &L {
        &self.layer
    }

    /// The layer, to change how it acts before the store is shared.
    pub fn layer_mut(&mut self) -> &mut L {
        &mut self.layer
    }
}

#[async_trait]
impl<L: Layer> ObjectStore for Layered<L> {
    async fn put(&self, key: &str, data: Bytes, mode: PutMode) -> Result<(), StoreError> {
        let bytes = data.len() as u64;
        let _held = self.layer.before(Request::Put { key, bytes }).await;
        self.inner.put(key, data, mode).await
    }

    async fn get(&self, key: &str, range: Option<Range<u64>>) -> Result<Bytes, StoreError> {
        let request = Request::Get {
            key,
            range: range.clone(),
        };
        let _held = self.layer.before(request).await;
        self.inner.get(key, range).await
    }

    async fn get_range_into(
        &self,
        key: &str,
        range: Range<u64>,
        buffer: Vec<u8>,
    ) -> Result<Vec<u8>, StoreError> {
        let request = Request::Get {
            key,
            range: Some(range.clone()),
        };
        let _held = self.layer.before(request).await;
        self.inner.get_range_into(key, range, buffer).await
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta, StoreError> {
        let _held = self.layer.before(Request::Head { key }).await;
        self.inner.head(key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StoreError> {
        let _held = self.layer.before(Request::List { prefix }).await;
        self.inner.list(prefix).await
    }

    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        let _held = self.layer.before(Request::Delete { key }).await;
        self.inner.delete(key).await
    }

    fn location(&self) -> String {
        self.inner.location()
    }

    fn is_remote(&self) -> bool {
        self.inner.is_remote()
    }

    async fn sweep_incomplete_uploads(
        &self,
        older_than: Duration,
    ) -> Result<SweepReport, StoreError> {
        let _held = self.layer.before(Request::Sweep).await;
        self.inner.sweep_incomplete_uploads(older_than).await
    }

    async fn wait_for_cleanup(&self) {
        self.inner.wait_for_cleanup().await
    }
}
