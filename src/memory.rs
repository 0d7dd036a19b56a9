//! Gives freed heap memory back to the system.
//!
//! glibc's allocator keeps memory that was freed, in every thread's arena,
//! for reuse: after a burst of a thousand streams the process stays at its
//! peak RSS. [`spawn_trimmer`] checks every [`CHECK_EVERY`] how much of the
//! process's resident anonymous memory the heap does not use (free chunks,
//! and what is not heap: stacks, statics) and, when that grew by more than
//! [`TRIM_ABOVE`] since the last trim (or its lowest since), returns the free
//! pages with `malloc_trim`. The allocator's own count of free bytes cannot
//! say it: a trim gives the pages of free chunks back but keeps the chunks,
//! so the count does not drop.
//!
//! The static musl builds allocate with mimalloc (the binary's global
//! allocator): it gives the pages of freed memory back itself, a purge delay
//! (10 ms; 100 ms for whole segments back in its arenas) after they were
//! freed, but only when the owning thread next calls into it.
//! On an idle process that is never: the trimmer calls `mi_collect` every
//! [`CHECK_EVERY`], which runs the purges that are due. `mi_collect` purges
//! only the calling thread's pages (and the arenas, program-wide), and the
//! trimmer runs on one worker thread: the runtime's other workers call
//! [`on_thread_park`] as they go idle, so the pages a worker freed in a
//! burst go back even when it then sleeps until the next one (1000 closed
//! streams left ~1.5 MiB more resident per process 3 s later without it).
//!
//! Between two checks, freed buffers stay in their arena for reuse: glibc's
//! own thresholds (its top-of-heap trim at 128 KiB and more, mmap for 128 KiB
//! and more, both moving) gave every few 64 KiB buffers of a bulk transfer
//! back to the kernel, and the next ones were faulted in again, page by page
//! (~300 000 minor faults per GB through a tunnel). The thresholds are fixed
//! higher; the trimmer still returns what stays free.

use std::time::Duration;

/// How often the allocator's free memory is looked at.
pub const CHECK_EVERY: Duration = Duration::from_secs(2);
/// Growth of resident memory the heap does not use below this is kept for reuse.
pub const TRIM_ABOVE: usize = 1024 * 1024;

/// A worker thread calls `mi_collect` as it parks at most this often.
pub const PARK_COLLECT_EVERY: Duration = Duration::from_millis(10);

/// For the runtime's `on_thread_park`: the thread's due purges (see the
/// module docs), at most once per [`PARK_COLLECT_EVERY`] per thread; a
/// no-op where the allocator is not mimalloc.
pub fn on_thread_park() {
    #[cfg(target_env = "musl")]
    {
        use std::cell::Cell;
        use std::time::Instant;
        thread_local! {
            static LAST: Cell<Option<Instant>> = const { Cell::new(None) };
        }
        let now = Instant::now();
        if LAST.get().is_some_and(|last| now.duration_since(last) < PARK_COLLECT_EVERY) {
            return;
        }
        LAST.set(Some(now));
        // SAFETY: as in spawn_trimmer.
        unsafe { libmimalloc_sys::mi_collect(false) };
    }
}

/// Starts the background trimmer on the current runtime (a no-op where the
/// allocator is neither glibc's nor mimalloc).
pub fn spawn_trimmer() {
    #[cfg(target_env = "musl")]
    tokio::spawn(async {
        let mut tick = tokio::time::interval(CHECK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            // SAFETY: mi_collect may be called at any time from any thread;
            // `false`: only the purges that are due, memory freed just now
            // stays for reuse.
            unsafe { libmimalloc_sys::mi_collect(false) };
        }
    });
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    glibc::keep_buffers();
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    tokio::spawn(async {
        let mut trimmer = glibc::Trimmer::default();
        let mut tick = tokio::time::interval(CHECK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            trimmer.check();
        }
    });
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod glibc {
    use super::TRIM_ABOVE;

    /// Allocations below this come from the arenas (reused), not from mmap.
    const MMAP_THRESHOLD: i32 = 4 * 1024 * 1024;
    /// glibc gives the top of an arena back on `free` only above this.
    const TRIM_THRESHOLD: i32 = 16 * 1024 * 1024;

    /// What the allocator and the kernel say about the heap, in bytes.
    #[derive(Debug, Clone, Copy)]
    pub struct Usage {
        /// Free bytes held by the allocator, all arenas (resident or not).
        pub free: usize,
        /// Bytes the program has allocated and not freed.
        pub in_use: usize,
        /// The process's resident anonymous memory (heap, stacks, statics).
        pub resident_anon: usize,
    }

    impl Usage {
        pub fn now() -> Usage {
            // SAFETY: mallinfo2 only reads the allocator's statistics.
            let info = unsafe { libc::mallinfo2() };
            Usage { free: info.fordblks, in_use: info.uordblks + info.hblkhd, resident_anon: resident_anon() }
        }

        /// Resident memory the heap does not use: free pages not yet given back,
        /// and what is not heap.
        fn slack(&self) -> usize {
            self.resident_anon.saturating_sub(self.in_use)
        }
    }

    /// Resident anonymous memory: resident minus file-backed and shared pages
    /// (`/proc/self/statm`); 0 if it cannot be read.
    fn resident_anon() -> usize {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
        let mut pages = statm.split_ascii_whitespace().skip(1).map(|n| n.parse::<usize>().unwrap_or(0));
        let (resident, shared) = (pages.next().unwrap_or(0), pages.next().unwrap_or(0));
        // SAFETY: sysconf only reads a system constant.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        resident.saturating_sub(shared) * page
    }

    /// Decides when a trim is worth it: when the resident memory the heap does
    /// not use grew by more than [`TRIM_ABOVE`] over the lowest seen since the
    /// last trim, and the allocator holds that much free.
    #[derive(Debug, Default)]
    pub struct Trimmer {
        /// The lowest slack since the last trim (0 before the first one).
        base: usize,
    }

    impl Trimmer {
        /// Looks, and trims if worth it; returns whether it did.
        pub fn check(&mut self) -> bool {
            let before = Usage::now();
            if before.free <= TRIM_ABOVE || before.slack() <= self.base + TRIM_ABOVE {
                self.base = self.base.min(before.slack());
                return false;
            }
            trim();
            let after = Usage::now();
            self.base = after.slack();
            tracing::debug!(
                free = before.free,
                resident_before = before.resident_anon,
                resident_after = after.resident_anon,
                "returned free heap memory"
            );
            true
        }
    }

    /// Fixes the mmap and trim thresholds (see the module docs).
    pub fn keep_buffers() {
        // SAFETY: mallopt only sets allocator parameters; valid values.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
            libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
        }
    }

    /// Releases free memory at the top and in the middle of every arena.
    pub fn trim() {
        // SAFETY: malloc_trim is safe to call at any time from any thread.
        unsafe { libc::malloc_trim(0) };
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::glibc::{Trimmer, Usage, keep_buffers};

    const MIB: usize = 1024 * 1024;

    /// Allocates `bytes` in touched 16 KiB blocks (arena memory, not mmap),
    /// then frees all but the last, which keeps them from being the top of
    /// the arena (that glibc gives back by itself).
    fn burst(bytes: usize) -> Vec<u8> {
        let n = bytes / (16 * 1024);
        let mut blocks = Vec::with_capacity(n);
        blocks.extend((0..n).map(|_| vec![1u8; 16 * 1024]));
        blocks.pop().expect("blocks")
    }

    #[test]
    fn memory_freed_again_after_a_trim_is_returned_again() {
        // One thread, so the blocks come from one arena and the test's own
        // allocations do not mix with other tests' between the steps.
        std::thread::spawn(|| {
            keep_buffers();
            let mut trimmer = Trimmer::default();
            // A first burst: trimmed (the allocator's free count stays high).
            let _first = burst(24 * MIB);
            assert!(trimmer.check(), "the first burst is trimmed: {:?}", Usage::now());
            // A second, larger one, freed again: its pages are resident again.
            let _second = burst(32 * MIB);
            let before = Usage::now();
            assert!(trimmer.check(), "the second burst is trimmed too: {before:?}");
            let after = Usage::now();
            assert!(
                after.resident_anon + 16 * MIB < before.resident_anon,
                "resident memory given back: {before:?} -> {after:?}"
            );
            // Nothing new freed: no trim.
            assert!(!trimmer.check(), "no second trim without new free memory: {:?}", Usage::now());
        })
        .join()
        .unwrap();
    }
}
