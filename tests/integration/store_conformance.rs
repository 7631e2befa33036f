//! The one conformance suite every [`ObjectStore`] backend passes: the
//! contract written on the trait, checked case by case. [`check_store`] runs
//! all cases against an empty store; the `file://` runs are here, the S3 runs
//! in `s3.rs` against a real MinIO server.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use haulage::store::local::LocalStore;
use haulage::store::{DynStore, PutMode, StoreError};

/// Deterministic, incompressible-looking test bytes.
pub fn pattern(len: usize, seed: u64) -> Bytes {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect::<Vec<u8>>()
        .into()
}

/// Run every case against `store`, which must start empty.
pub async fn check_store(store: DynStore) {
    list_of_an_empty_store_is_empty(&store).await;
    put_then_get_returns_the_same_bytes(&store).await;
    overwrite_replaces_the_object(&store).await;
    empty_objects_round_trip(&store).await;
    missing_objects_are_not_found(&store).await;
    ranges_return_exactly_the_requested_bytes(&store).await;
    ranges_past_the_end_are_errors_not_short_reads(&store).await;
    create_refuses_to_replace_an_existing_object(&store).await;
    list_is_recursive_and_filters_by_prefix(&store).await;
    delete_removes_and_tolerates_missing_objects(&store).await;
    invalid_keys_are_refused(&store).await;
    concurrent_puts_all_land(&store).await;
    location_names_the_store(&store).await;
}

async fn list_of_an_empty_store_is_empty(store: &DynStore) {
    let listed = store.list("").await.expect("list empty store");
    assert!(listed.is_empty(), "a fresh store lists {listed:?}");
}

async fn put_then_get_returns_the_same_bytes(store: &DynStore) {
    for (key, size) in [
        ("roundtrip/small", 10),
        ("roundtrip/a/b/c/deep", 1000),
        ("roundtrip/mib", 1 << 20),
    ] {
        let data = pattern(size, size as u64);
        store
            .put(key, data.clone(), PutMode::Overwrite)
            .await
            .expect("put");
        assert_eq!(store.get(key, None).await.expect("get"), data, "{key}");
        let meta = store.head(key).await.expect("head");
        assert_eq!(meta.key, key);
        assert_eq!(meta.size, size as u64);
    }
}

async fn overwrite_replaces_the_object(store: &DynStore) {
    let key = "overwrite/object";
    store
        .put(key, pattern(500, 1), PutMode::Overwrite)
        .await
        .expect("first put");
    let second = pattern(300, 2);
    store
        .put(key, second.clone(), PutMode::Overwrite)
        .await
        .expect("second put");
    assert_eq!(store.get(key, None).await.expect("get"), second);
    assert_eq!(store.head(key).await.expect("head").size, 300);
}

async fn empty_objects_round_trip(store: &DynStore) {
    let key = "empty/object";
    store
        .put(key, Bytes::new(), PutMode::Overwrite)
        .await
        .expect("put empty");
    assert!(store.get(key, None).await.expect("get empty").is_empty());
    assert_eq!(store.head(key).await.expect("head empty").size, 0);
    assert!(
        store
            .get(key, Some(0..0))
            .await
            .expect("empty range")
            .is_empty()
    );
}

async fn missing_objects_are_not_found(store: &DynStore) {
    let key = "missing/nothing-here";
    let error = store.get(key, None).await.expect_err("get missing");
    assert!(error.is_not_found(), "get: {error}");
    let error = store
        .get(key, Some(0..1))
        .await
        .expect_err("ranged get missing");
    assert!(error.is_not_found(), "ranged get: {error}");
    let error = store.head(key).await.expect_err("head missing");
    assert!(error.is_not_found(), "head: {error}");
    assert!(
        error.to_string().contains(key),
        "the error names the key: {error}"
    );
}

async fn ranges_return_exactly_the_requested_bytes(store: &DynStore) {
    let key = "ranges/object";
    let data = pattern(10_000, 7);
    store
        .put(key, data.clone(), PutMode::Overwrite)
        .await
        .expect("put");
    for range in [
        0..1,
        0..10_000,
        1234..5678,
        9_999..10_000,
        5_000..5_001,
        10_000..10_000,
        42..42,
    ] {
        let got = store
            .get(key, Some(range.clone()))
            .await
            .expect("ranged get");
        assert_eq!(
            got,
            data.slice(range.start as usize..range.end as usize),
            "range {range:?}"
        );
    }
}

async fn ranges_past_the_end_are_errors_not_short_reads(store: &DynStore) {
    let key = "ranges/short";
    store
        .put(key, pattern(100, 9), PutMode::Overwrite)
        .await
        .expect("put");
    for range in [90..101, 100..200, 150..160, 101..101] {
        match store.get(key, Some(range.clone())).await {
            Ok(bytes) => panic!(
                "range {range:?} of a 100-byte object returned {} bytes",
                bytes.len()
            ),
            Err(error) => assert!(
                matches!(error, StoreError::Permanent { .. }),
                "range {range:?}: {error}"
            ),
        }
    }
    #[allow(
        clippy::reversed_empty_ranges,
        reason = "a reversed range is the case under test"
    )]
    let reversed = 20..10;
    assert!(
        store.get(key, Some(reversed)).await.is_err(),
        "a reversed range is refused"
    );
}

async fn create_refuses_to_replace_an_existing_object(store: &DynStore) {
    let key = "create/config";
    let first = pattern(64, 3);
    store
        .put(key, first.clone(), PutMode::Create)
        .await
        .expect("first create");
    let error = store
        .put(key, pattern(64, 4), PutMode::Create)
        .await
        .expect_err("second create");
    assert!(matches!(error, StoreError::AlreadyExists { .. }), "{error}");
    assert_eq!(
        store.get(key, None).await.expect("get"),
        first,
        "the first writer's bytes stay"
    );
    // A create on a fresh key next to it is unaffected.
    store
        .put("create/other", first.clone(), PutMode::Create)
        .await
        .expect("create other");
}

async fn list_is_recursive_and_filters_by_prefix(store: &DynStore) {
    let keys = ["tree/a", "tree/b/c", "tree/b/d/e", "tree/bc", "treetop"];
    for (index, key) in keys.iter().enumerate() {
        store
            .put(key, pattern(index + 1, index as u64), PutMode::Overwrite)
            .await
            .expect("put");
    }
    let listed = |prefix: &'static str| async move {
        let mut objects: BTreeMap<String, u64> = BTreeMap::new();
        for meta in store.list(prefix).await.expect("list") {
            assert!(
                objects.insert(meta.key.clone(), meta.size).is_none(),
                "{} listed twice",
                meta.key
            );
        }
        objects
    };
    let tree = listed("tree/").await;
    assert_eq!(
        tree.into_iter().collect::<Vec<_>>(),
        [
            ("tree/a".to_string(), 1),
            ("tree/b/c".to_string(), 2),
            ("tree/b/d/e".to_string(), 3),
            ("tree/bc".to_string(), 4),
        ]
    );
    let b_dir: Vec<String> = listed("tree/b/").await.into_keys().collect();
    assert_eq!(b_dir, ["tree/b/c", "tree/b/d/e"]);
    let b_prefix: Vec<String> = listed("tree/b").await.into_keys().collect();
    assert_eq!(b_prefix, ["tree/b/c", "tree/b/d/e", "tree/bc"]);
    assert!(listed("tree/zzz/").await.is_empty());
    let everything = listed("").await;
    for key in keys {
        assert!(
            everything.contains_key(key),
            "{key} missing from the full listing"
        );
    }
}

async fn delete_removes_and_tolerates_missing_objects(store: &DynStore) {
    let key = "delete/object";
    store
        .put(key, pattern(10, 5), PutMode::Overwrite)
        .await
        .expect("put");
    store.delete(key).await.expect("delete");
    assert!(
        store
            .head(key)
            .await
            .expect_err("head deleted")
            .is_not_found()
    );
    assert!(store.list("delete/").await.expect("list").is_empty());
    store.delete(key).await.expect("deleting again succeeds");
    store
        .delete("delete/never-existed")
        .await
        .expect("deleting a missing key succeeds");
}

async fn invalid_keys_are_refused(store: &DynStore) {
    for key in [
        "",
        "/absolute",
        "a//b",
        "../escape",
        "a/../../b",
        "./a",
        "trailing/",
    ] {
        let error = store
            .put(key, Bytes::from_static(b"x"), PutMode::Overwrite)
            .await
            .expect_err("invalid key refused");
        assert!(
            matches!(error, StoreError::Permanent { .. }),
            "{key:?}: {error}"
        );
        assert!(store.get(key, None).await.is_err(), "get {key:?}");
        assert!(store.head(key).await.is_err(), "head {key:?}");
    }
}

async fn concurrent_puts_all_land(store: &DynStore) {
    let mut tasks = tokio::task::JoinSet::new();
    for index in 0..16u64 {
        let store = store.clone();
        tasks.spawn(async move {
            let key = format!("concurrent/{index:02}");
            store
                .put(&key, pattern(4096, index), PutMode::Overwrite)
                .await
        });
    }
    while let Some(result) = tasks.join_next().await {
        result.expect("task").expect("concurrent put");
    }
    let listed = store.list("concurrent/").await.expect("list");
    assert_eq!(listed.len(), 16);
    for index in 0..16u64 {
        let key = format!("concurrent/{index:02}");
        assert_eq!(
            store.get(&key, None).await.expect("get"),
            pattern(4096, index)
        );
    }
}

async fn location_names_the_store(store: &DynStore) {
    let location = store.location();
    assert!(
        location.starts_with("file://") || location.starts_with("s3://"),
        "{location}"
    );
    // Through every wrapper: a backup keeps a second pack upload in
    // flight only to a remote store.
    assert_eq!(
        store.is_remote(),
        location.starts_with("s3://"),
        "{location}"
    );
}

#[tokio::test]
async fn local_store_passes_the_conformance_suite() {
    let dir = tempfile::tempdir().expect("tempdir");
    check_store(Arc::new(LocalStore::new(dir.path().join("repo")))).await;
}

#[tokio::test]
async fn local_store_behind_every_wrapper_passes_the_conformance_suite() {
    let dir = tempfile::tempdir().expect("tempdir");
    let options = haulage::store::StoreOptions {
        max_concurrent_requests: Some(3),
        upload_bytes_per_second: std::num::NonZeroU64::new(512 * 1024 * 1024),
        ..Default::default()
    };
    let url = format!("file://{}", dir.path().join("repo").display());
    let store = haulage::store::open_store(&url, &options)
        .await
        .expect("open");
    check_store(store).await;
}
