//! Reading many byte ranges of one object with few requests.
//!
//! Restore reads blobs out of pack files: many small ranges of one object,
//! often next to each other. Every GET costs a round trip (and on a shared
//! S3 server, a request against its rate), so neighbouring ranges are merged
//! when the bytes skipped between them are cheaper than another request:
//! [`coalesce_ranges`] plans the merged reads, [`get_ranges`] performs them
//! on any [`ObjectStore`] and cuts the answers back into the ranges asked for.

use std::ops::Range;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};

use super::{ObjectStore, StoreError};

/// Default largest gap read through to merge two ranges. At tens of MiB/s,
/// 1 MiB costs about as much time as one request's latency.
pub const DEFAULT_COALESCE_GAP_BYTES: u64 = 1024 * 1024;
/// Largest merged read, so one merge never holds more than this in memory.
pub const MAX_COALESCED_READ_BYTES: u64 = 64 * 1024 * 1024;
/// Merged reads of one call in flight at once.
const READS_IN_FLIGHT: usize = 4;

/// Whether two ranges of one object are worth one read rather than two:
/// the gap between them (if any) is at most `max_gap` bytes and the read
/// covering both stays within `max_read` bytes.
pub fn fit_one_read(one: &Range<u64>, other: &Range<u64>, max_gap: u64, max_read: u64) -> bool {
    let gap = other
        .start
        .saturating_sub(one.end)
        .max(one.start.saturating_sub(other.end));
    let whole = one.end.max(other.end) - one.start.min(other.start);
    gap <= max_gap && whole <= max_read
}

/// Merge `ranges` into as few reads as possible: sorted, non-overlapping,
/// each covering one or more of the inputs, merging two neighbours when the
/// gap between them is at most `max_gap` bytes and the merged read stays
/// within `max_read` bytes (a single input longer than `max_read` is read
/// as it is). Every input range lies inside exactly one output range.
/// Reversed inputs (start > end) are left out; [`get_ranges`] refuses them.
pub fn coalesce_ranges(ranges: &[Range<u64>], max_gap: u64, max_read: u64) -> Vec<Range<u64>> {
    let mut sorted: Vec<Range<u64>> = ranges
        .iter()
        .filter(|range| range.start <= range.end)
        .cloned()
        .collect();
    sorted.sort_by_key(|range| (range.start, range.end));
    let mut merged: Vec<Range<u64>> = Vec::with_capacity(sorted.len());
    for range in sorted {
        if let Some(last) = merged.last_mut() {
            // Overlapping ranges must share a read; touching or nearby ones
            // only while the read stays within `max_read`.
            if range.start < last.end || fit_one_read(last, &range, max_gap, max_read) {
                last.end = last.end.max(range.end);
                continue;
            }
        }
        merged.push(range);
    }
    merged
}

/// Read every range of `key`, merging neighbours as [`coalesce_ranges`]
/// plans with `max_gap` and [`MAX_COALESCED_READ_BYTES`]. Returns one
/// `Bytes` per input range, in input order; the answers share the merged
/// reads' buffers rather than copying. Fails with the first failed read; a
/// range past the end of the object fails as [`ObjectStore::get`] does.
pub async fn get_ranges(
    store: &dyn ObjectStore,
    key: &str,
    ranges: &[Range<u64>],
    max_gap: u64,
) -> Result<Vec<Bytes>, StoreError> {
    get_ranges_capped(store, key, ranges, max_gap, MAX_COALESCED_READ_BYTES).await
}

/// [`get_ranges`] with a caller's cap on one merged read (`max_read`
/// bytes), for callers that bound their memory more tightly.
pub async fn get_ranges_capped(
    store: &dyn ObjectStore,
    key: &str,
    ranges: &[Range<u64>],
    max_gap: u64,
    max_read: u64,
) -> Result<Vec<Bytes>, StoreError> {
    let refuse = |message: String| StoreError::Permanent {
        location: store.location(),
        operation: "get",
        key: key.to_string(),
        message,
        cause: super::FailureCause::Other,
    };
    if let Some(reversed) = ranges.iter().find(|range| range.start > range.end) {
        return Err(refuse(format!(
            "byte range {}..{} ends before it starts",
            reversed.start, reversed.end
        )));
    }
    let reads = coalesce_ranges(ranges, max_gap, max_read);
    let fetched: Vec<(Range<u64>, Bytes)> = futures::stream::iter(reads)
        .map(|read| async move {
            let bytes = store.get(key, Some(read.clone())).await?;
            Ok::<_, StoreError>((read, bytes))
        })
        .buffered(READS_IN_FLIGHT)
        .try_collect()
        .await?;
    ranges
        .iter()
        .map(|range| {
            // The reads are sorted and disjoint: the one holding this range is
            // the last that starts at or before it.
            let holder = fetched
                .partition_point(|(read, _)| read.start <= range.start)
                .checked_sub(1)
                .map(|index| &fetched[index])
                .filter(|(read, _)| range.end <= read.end);
            let Some((read, bytes)) = holder else {
                return Err(refuse(format!(
                    "byte range {}..{} was not covered by any merged read",
                    range.start, range.end
                )));
            };
            let from = usize::try_from(range.start - read.start).unwrap_or(usize::MAX);
            let to = usize::try_from(range.end - read.start).unwrap_or(usize::MAX);
            if to > bytes.len() {
                return Err(refuse(format!(
                    "the store returned {} bytes for the {}-byte read {}..{}",
                    bytes.len(),
                    read.end - read.start,
                    read.start,
                    read.end
                )));
            }
            Ok(bytes.slice(from..to))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::store::PutMode;
    use crate::store::local::LocalStore;

    #[test]
    #[allow(
        clippy::single_range_in_vec_init,
        reason = "a list of one range is the expected plan"
    )]
    fn neighbours_merge_and_distant_ranges_do_not() {
        let merged = coalesce_ranges(&[0..10, 12..20, 100..110, 20..30], 5, 1000);
        assert_eq!(merged, [0..30, 100..110]);
        assert_eq!(coalesce_ranges(&[0..10, 12..20], 1, 1000), [0..10, 12..20]);
        // The read cap stops a merge, also of touching ranges, but not a
        // single long range, nor ranges that overlap.
        assert_eq!(coalesce_ranges(&[0..10, 10..20], 0, 20), [0..20]);
        assert_eq!(coalesce_ranges(&[0..10, 10..20], 0, 15), [0..10, 10..20]);
        assert_eq!(coalesce_ranges(&[0..10, 5..20], 0, 15), [0..20]);
        assert_eq!(coalesce_ranges(&[0..10, 11..20], 5, 15), [0..10, 11..20]);
        assert_eq!(coalesce_ranges(&[0..100], 5, 15), [0..100]);
    }

    proptest! {
        #[test]
        fn every_range_lies_in_exactly_one_disjoint_read(
            ranges in prop::collection::vec((0u64..10_000, 0u64..500).prop_map(|(start, len)| start..start + len), 0..40),
            max_gap in 0u64..2_000,
            max_read in 1u64..5_000,
        ) {
            let reads = coalesce_ranges(&ranges, max_gap, max_read);
            for pair in reads.windows(2) {
                prop_assert!(pair[0].end <= pair[1].start, "reads overlap: {:?}", pair);
                // Touching reads are split only by the cap.
                prop_assert!(
                    pair[0].end < pair[1].start || pair[1].end - pair[0].start > max_read,
                    "reads touch without need: {:?}", pair
                );
            }
            for range in &ranges {
                let holders = reads
                    .iter()
                    .filter(|read| read.start <= range.start && range.end <= read.end)
                    .count();
                prop_assert!(holders >= 1, "{:?} is in no read of {:?}", range, reads);
            }
            prop_assert!(reads.len() <= ranges.len());
        }
    }

    #[tokio::test]
    async fn get_ranges_returns_each_range_in_input_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = LocalStore::new(dir.path());
        let data: Bytes = (0..50_000u32)
            .map(|index| (index % 251) as u8)
            .collect::<Vec<_>>()
            .into();
        store
            .put("pack", data.clone(), PutMode::Overwrite)
            .await
            .expect("put");
        let ranges = [
            40_000..40_100,
            0..10,
            10..20,
            5..15,
            30_000..30_000,
            49_990..50_000,
        ];
        let got = get_ranges(&store, "pack", &ranges, 1024)
            .await
            .expect("ranges");
        for (range, bytes) in ranges.iter().zip(&got) {
            assert_eq!(
                bytes,
                &data.slice(range.start as usize..range.end as usize),
                "{range:?}"
            );
        }
        let error = get_ranges(&store, "pack", &[0..10, 49_999..50_001], 1024)
            .await
            .expect_err("past the end");
        assert!(matches!(error, StoreError::Permanent { .. }), "{error}");
        // A reversed range (written as a struct so it reads as intended).
        let reversed = [Range { start: 10, end: 5 }];
        assert!(get_ranges(&store, "pack", &reversed, 1024).await.is_err());
    }
}
