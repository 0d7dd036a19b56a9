//! The async runtime the long-running commands (edge, agents, operator) run
//! on: tokio's multi-threaded scheduler, with as many worker threads as
//! `--worker-threads` says or, by default, [`default_worker_threads`].

use std::num::NonZeroUsize;

/// CPUs up to which a process runs one worker thread by default.
const ONE_WORKER_UP_TO: usize = 2;

/// Worker threads for a process that may use `cpus` CPUs: one on two CPUs
/// or fewer, one per CPU above. On two CPUs shared with the services and
/// clients it carries for, a second worker cost more than it added: a task
/// woken on the other worker is a futex wake-up and a context switch, five
/// times as many per request, and each request cost 15 % more CPU
/// (`bench/README.md`, session 30).
pub fn default_worker_threads(cpus: usize) -> usize {
    if cpus <= ONE_WORKER_UP_TO { 1 } else { cpus }
}

/// The runtime, with `worker_threads` workers (the default when `None`).
/// The CPUs counted are those this process may use: its affinity and its
/// cgroup's CPU quota (a container's CPU limit) are taken into account.
pub fn build(worker_threads: Option<NonZeroUsize>) -> std::io::Result<tokio::runtime::Runtime> {
    let workers = worker_threads.map_or_else(
        || default_worker_threads(std::thread::available_parallelism().map_or(1, NonZeroUsize::get)),
        NonZeroUsize::get,
    );
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .on_thread_park(crate::memory::on_thread_park)
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_worker_on_two_cpus_or_fewer_one_per_cpu_above() {
        assert_eq!([1, 2, 3, 4, 16].map(default_worker_threads), [1, 1, 3, 4, 16]);
    }

    #[test]
    fn the_runtime_has_the_workers_asked_for() {
        let runtime = build(NonZeroUsize::new(3)).unwrap();
        assert_eq!(runtime.metrics().num_workers(), 3);
        let runtime = build(None).unwrap();
        let cpus = std::thread::available_parallelism().unwrap().get();
        assert_eq!(runtime.metrics().num_workers(), default_worker_threads(cpus));
    }
}
