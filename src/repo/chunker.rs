//! Content-defined chunking with FastCDC (2020), gear table seeded per
//! repository.
//!
//! Pure: the chunker finds cut points in a byte slice; reading files is the
//! engine's job. To get the same cut points as chunking the whole stream at
//! once, a caller hands [`Chunker::cut`] either at least
//! [`ChunkerParameters::max_bytes`] bytes or everything up to the end of the
//! stream; a caller reading a stream a block at a time asks
//! [`Chunker::find_cut`] after each block instead, which looks at each
//! byte once and needs no more than the chunk itself read.

use fastcdc::v2020;
use serde::{Deserialize, Serialize};

/// Chunk size bounds, fixed per repository.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChunkerParameters {
    /// No cut before this many bytes (except at the end of a stream).
    pub min_bytes: u32,
    /// Expected chunk size.
    pub average_bytes: u32,
    /// A cut is forced at this many bytes.
    pub max_bytes: u32,
    /// FastCDC normalization level (0..=3).
    pub normalization: u8,
}

impl Default for ChunkerParameters {
    /// 512 KiB / 1 MiB / 4 MiB: large enough that the index of a terabyte
    /// volume fits in a stage pod's memory, small enough that an edit costs
    /// about a megabyte. The 4 MiB maximum bounds the memory each chunk in
    /// flight can take.
    fn default() -> Self {
        ChunkerParameters {
            min_bytes: 512 * 1024,
            average_bytes: 1024 * 1024,
            max_bytes: 4 * 1024 * 1024,
            normalization: 1,
        }
    }
}

impl ChunkerParameters {
    /// Check the bounds FastCDC accepts.
    pub fn validate(&self) -> Result<(), String> {
        let (min, avg, max) = (
            self.min_bytes as usize,
            self.average_bytes as usize,
            self.max_bytes as usize,
        );
        if !(v2020::MINIMUM_MIN..=v2020::MINIMUM_MAX).contains(&min)
            || !(v2020::AVERAGE_MIN..=v2020::AVERAGE_MAX).contains(&avg)
            || !(v2020::MAXIMUM_MIN..=v2020::MAXIMUM_MAX).contains(&max)
        {
            return Err(format!(
                "sizes {min}/{avg}/{max} are outside what FastCDC supports"
            ));
        }
        if !(min <= avg && avg <= max) {
            return Err(format!(
                "sizes must satisfy min <= average <= max, got {min}/{avg}/{max}"
            ));
        }
        if !min.is_multiple_of(2) || !avg.is_multiple_of(2) || !max.is_multiple_of(2) {
            return Err("sizes must be even".into());
        }
        if self.normalization > 3 {
            return Err(format!("normalization {} is above 3", self.normalization));
        }
        Ok(())
    }
}

/// Where [`Chunker::find_cut`] stopped looking for a cut: the next pair of
/// bytes to test and the rolling hash before it.
#[derive(Debug, Clone, Copy)]
pub struct CutSearch {
    pair: usize,
    hash: u64,
}

/// Finds content-defined cut points.
#[derive(Debug, Clone)]
pub struct Chunker {
    parameters: ChunkerParameters,
    mask_s: u64,
    mask_l: u64,
    /// FastCDC's gear tables XORed with the seed, as arrays: the scan
    /// indexes them by a byte without bounds checks.
    gear: Box<[u64; 256]>,
    gear_ls: Box<[u64; 256]>,
}

impl Chunker {
    /// A chunker for validated parameters and a repository's gear seed.
    pub fn new(parameters: ChunkerParameters, gear_seed: u64) -> Self {
        let level = match parameters.normalization {
            0 => v2020::Normalization::Level0,
            1 => v2020::Normalization::Level1,
            2 => v2020::Normalization::Level2,
            _ => v2020::Normalization::Level3,
        };
        let (mask_s, mask_l) = v2020::select_masks(parameters.average_bytes as usize, level);
        let (gear, gear_ls) = v2020::get_gear_with_seed(gear_seed);
        let table = |entries: std::borrow::Cow<'static, [u64]>| -> Box<[u64; 256]> {
            Box::new(
                entries
                    .as_ref()
                    .try_into()
                    .expect("FastCDC's gear tables have 256 entries"),
            )
        };
        let (gear, gear_ls) = (table(gear), table(gear_ls));
        Chunker {
            parameters,
            mask_s,
            mask_l,
            gear,
            gear_ls,
        }
    }

    /// The parameters in use.
    pub fn parameters(&self) -> &ChunkerParameters {
        &self.parameters
    }

    /// Length of the first chunk of `data`. `data` must be at least
    /// `max_bytes` long unless it is the end of the stream; for an empty
    /// slice the result is 0.
    pub fn cut(&self, data: &[u8]) -> usize {
        self.find_cut(&mut self.cut_search(), data, true)
            .unwrap_or(data.len())
    }

    /// A new search for the first cut of a chunk read a part at a time
    /// (see [`Chunker::find_cut`]).
    pub fn cut_search(&self) -> CutSearch {
        CutSearch {
            pair: self.parameters.min_bytes as usize / 2,
            hash: 0,
        }
    }

    /// The first cut of a chunk whose bytes so far are `data`, carrying on
    /// `search` from where the last call on a shorter `data` stopped, so
    /// each byte is looked at once however the chunk is read; `None` when
    /// the cut lies beyond `data` (read more and call again), unless
    /// `at_end` says the stream ends with `data`. The cut is the one
    /// FastCDC's `cut_gear` finds in the whole stream (the same scan, pair
    /// by pair, held between calls; property-tested against it).
    pub fn find_cut(&self, search: &mut CutSearch, data: &[u8], at_end: bool) -> Option<usize> {
        let min = self.parameters.min_bytes as usize;
        let max = self.parameters.max_bytes as usize;
        if data.len() <= min {
            return at_end.then_some(data.len());
        }
        let window = data.len().min(max);
        let (gear, gear_ls) = (&*self.gear, &*self.gear_ls);
        let strict_pair_end = self.parameters.average_bytes as usize / 2;
        let data = &data[..window];
        // The state in locals while scanning, and one loop per mask, as in
        // FastCDC's own scan (whose first byte of a pair is tested with the
        // mask shifted left).
        let mut pair = search.pair;
        let mut hash = search.hash;
        for (end, mask) in [
            (strict_pair_end.min(window / 2), self.mask_s),
            (window / 2, self.mask_l),
        ] {
            let mask_ls = mask << 1;
            while pair < end {
                let at = pair * 2;
                hash = (hash << 2).wrapping_add(gear_ls[data[at] as usize]);
                if hash & mask_ls == 0 {
                    return Some(at.max(1));
                }
                hash = hash.wrapping_add(gear[data[at + 1] as usize]);
                if hash & mask == 0 {
                    return Some(at + 1);
                }
                pair += 1;
            }
        }
        *search = CutSearch { pair, hash };
        (at_end || data.len() >= max).then_some(window)
    }

    /// Split a whole in-memory stream into chunk lengths.
    pub fn chunk_lengths(&self, mut data: &[u8]) -> Vec<usize> {
        let mut lengths = Vec::new();
        while !data.is_empty() {
            let length = self.cut(data);
            lengths.push(length);
            data = &data[length..];
        }
        lengths
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn small_chunker() -> Chunker {
        Chunker::new(
            ChunkerParameters {
                min_bytes: 1024,
                average_bytes: 4096,
                max_bytes: 16384,
                normalization: 1,
            },
            42,
        )
    }

    proptest! {
        #[test]
        fn chunks_cover_the_input_and_respect_the_bounds(data in proptest::collection::vec(any::<u8>(), 0..100_000)) {
            let chunker = small_chunker();
            let lengths = chunker.chunk_lengths(&data);
            prop_assert_eq!(lengths.iter().sum::<usize>(), data.len());
            if let Some((_, all_but_last)) = lengths.split_last() {
                for length in all_but_last {
                    prop_assert!(*length >= 1024 && *length <= 16384);
                }
            }
        }
    }

    proptest! {
        #[test]
        fn a_stream_read_in_parts_is_cut_where_the_whole_is(
            data in proptest::collection::vec(any::<u8>(), 0..60_000),
            reads in proptest::collection::vec(1usize..9_000, 1..40),
            normalization in 0u8..=3,
        ) {
            // Normalization 3 makes the masks before and after the
            // average far apart, so a scan that switches at the wrong pair
            // cuts elsewhere.
            let parameters = ChunkerParameters { normalization, ..*small_chunker().parameters() };
            let chunker = Chunker::new(parameters, 42);
            let max = parameters.max_bytes as usize;
            let mut lengths = Vec::new();
            let mut chunk_start = 0;
            let mut read_end = 0;
            let mut search = chunker.cut_search();
            for read in reads.iter().cycle() {
                if chunk_start == data.len() {
                    break;
                }
                read_end = (read_end + read).min(data.len());
                let at_end = read_end == data.len();
                loop {
                    let held = &data[chunk_start..read_end];
                    let Some(cut) = chunker.find_cut(&mut search, held, at_end) else {
                        prop_assert!(held.len() < max, "no cut in {} bytes", held.len());
                        break;
                    };
                    if cut == 0 {
                        break;
                    }
                    lengths.push(cut);
                    chunk_start += cut;
                    search = chunker.cut_search();
                }
            }
            prop_assert_eq!(&lengths, &fastcdc_lengths(&chunker, &data));
            prop_assert_eq!(lengths, chunker.chunk_lengths(&data));
        }
    }

    /// The chunk lengths FastCDC's own scan gives the whole stream.
    fn fastcdc_lengths(chunker: &Chunker, mut data: &[u8]) -> Vec<usize> {
        let parameters = chunker.parameters;
        let mut lengths = Vec::new();
        while !data.is_empty() {
            let (_, length) = v2020::cut_gear(
                data,
                parameters.min_bytes as usize,
                parameters.average_bytes as usize,
                parameters.max_bytes as usize,
                chunker.mask_s,
                chunker.mask_l,
                chunker.mask_s << 1,
                chunker.mask_l << 1,
                &chunker.gear[..],
                &chunker.gear_ls[..],
            );
            lengths.push(length);
            data = &data[length..];
        }
        lengths
    }

    #[test]
    fn an_insertion_at_the_front_changes_only_the_first_chunks() {
        let data: Vec<u8> = (0..2_000_000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let chunker = small_chunker();
        let mut shifted = b"0123456789".to_vec();
        shifted.extend_from_slice(&data);
        let cut_set = |data: &[u8]| {
            let mut offset = 0;
            let mut chunks = std::collections::HashSet::new();
            for length in chunker.chunk_lengths(data) {
                chunks.insert(data[offset..offset + length].to_vec());
                offset += length;
            }
            chunks
        };
        let before = cut_set(&data);
        let after = cut_set(&shifted);
        let new = after.difference(&before).count();
        assert!(new <= 3, "{new} new chunks out of {}", after.len());
    }

    #[test]
    fn different_seeds_cut_differently() {
        let data: Vec<u8> = (0..500_000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 7) as u8)
            .collect();
        let parameters = *small_chunker().parameters();
        let a = Chunker::new(parameters, 1).chunk_lengths(&data);
        let b = Chunker::new(parameters, 2).chunk_lengths(&data);
        assert_ne!(a, b);
    }
}
