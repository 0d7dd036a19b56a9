//! Gives freed heap memory back to the system.
//!
//! glibc's allocator keeps memory that was freed, in every thread's arena,
//! for reuse: after a burst of a thousand streams the process stays at its
//! peak RSS. [`spawn_trimmer`] checks every [`CHECK_EVERY`] how much free
//! memory the allocator holds and, when it grew past [`TRIM_ABOVE`] (and past
//! twice what the last trim could not release), returns it with
//! `malloc_trim`.
//!
//! The static musl builds allocate with mimalloc (the binary's global
//! allocator): it gives the pages of freed memory back itself, a purge delay
//! (1 s) after they were freed, but only when some thread next calls into it.
//! On an idle process that is never: the trimmer calls `mi_collect` every
//! [`CHECK_EVERY`], which runs the purges that are due.
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
/// Free heap memory below this is kept for reuse.
pub const TRIM_ABOVE: usize = 1024 * 1024;

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
        let mut floor = 0usize;
        let mut tick = tokio::time::interval(CHECK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let free = glibc::free_bytes();
            if free > TRIM_ABOVE.max(2 * floor) {
                glibc::trim();
                floor = glibc::free_bytes();
                tracing::debug!(free_before = free, free_after = floor, "returned free heap memory");
            }
        }
    });
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod glibc {
    /// Allocations below this come from the arenas (reused), not from mmap.
    const MMAP_THRESHOLD: i32 = 4 * 1024 * 1024;
    /// glibc gives the top of an arena back on `free` only above this.
    const TRIM_THRESHOLD: i32 = 16 * 1024 * 1024;

    /// Free bytes held by the allocator, all arenas.
    pub fn free_bytes() -> usize {
        // SAFETY: mallinfo2 only reads the allocator's statistics.
        unsafe { libc::mallinfo2() }.fordblks
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
