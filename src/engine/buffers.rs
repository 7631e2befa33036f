//! A small pool of large byte buffers, so the pipeline reuses its chunk
//! and compression buffers instead of allocating and freeing megabytes per
//! chunk. With glibc, that churn across worker threads left freed buffers
//! cached in per-thread arenas and doubled peak RSS (docs/benchmarks.md).

use std::sync::Mutex;

/// Reusable buffers of one capacity.
#[derive(Debug)]
pub struct BufferPool {
    free: Mutex<Vec<Vec<u8>>>,
    capacity: usize,
    max_free: usize,
}

impl BufferPool {
    /// A pool handing out buffers of `capacity` bytes and keeping at most
    /// `max_free` of them when returned.
    pub fn new(capacity: usize, max_free: usize) -> Self {
        BufferPool {
            free: Mutex::new(Vec::with_capacity(max_free)),
            capacity,
            max_free,
        }
    }

    /// An empty buffer with at least the pool's capacity.
    pub fn take(&self) -> Vec<u8> {
        self.free
            .lock()
            .expect("buffer pool")
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(self.capacity))
    }

    /// Return a buffer; kept if it is large enough and the pool has room.
    pub fn give(&self, mut buffer: Vec<u8>) {
        if buffer.capacity() < self.capacity {
            return;
        }
        buffer.clear();
        let mut free = self.free.lock().expect("buffer pool");
        if free.len() < self.max_free {
            free.push(buffer);
        }
    }

    /// Capacity of the buffers handed out.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returned_buffers_are_reused_up_to_the_limit() {
        let pool = BufferPool::new(1024, 1);
        let mut first = pool.take();
        first.extend_from_slice(b"data");
        let address = first.as_ptr();
        pool.give(first);
        pool.give(Vec::with_capacity(4096));
        let again = pool.take();
        assert!(again.is_empty());
        assert_eq!(
            again.as_ptr(),
            address,
            "the first returned buffer is reused"
        );
        pool.give(Vec::with_capacity(10));
        assert_eq!(
            pool.free.lock().unwrap().len(),
            0,
            "small buffers are not kept"
        );
    }
}
