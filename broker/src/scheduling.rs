//! The CPU scheduling policy of the broker's threads (`[process] cpu_scheduling`).
//!
//! A broker's threads hand work to each other all the time: a client session on the main
//! thread to a partition's thread, the partition to its fsync thread and back, one node to the
//! others over loopback. Under Linux's default policy (`SCHED_OTHER`) a thread that is woken
//! may preempt the thread that woke it (wakeup preemption), so on a busy machine a hand-off is
//! often a context switch in the middle of the waker's batch, and the work is cut into smaller
//! batches. `SCHED_BATCH` (`sched(7)`) is the same fair scheduler without wakeup preemption:
//! the woken thread runs on an idle core at once, or when the waker sleeps or its slice ends.
//!
//! The policy is a per-thread attribute that new threads inherit, so [`apply_to_process`],
//! called on the main thread before any other thread starts, sets it for every thread of the
//! process; the elector's thread then calls [`keep_normal_on_this_thread`], so that its timers
//! (heartbeats, the leader-loss check, election timeouts: failover) are never delayed behind a
//! busy thread's slice.
//!
//! Figures (docs/bench/JOURNAL.md, "Fewer context switches"): metadata commits with 64 in flight
//! 1.03-1.48x (median 1.22x); at 50,000 msgs/s paced a lower ACK p99 and broker CPU per
//! message (median 0.91x) in 6 of 7 runs; no difference at 30,000 msgs/s or at the maximum
//! rate; failover times unchanged.

use bmq_config::CpuScheduling;

/// Sets `policy` on the calling thread, from which every thread started later inherits it.
/// Call it on the main thread before any other thread starts.
///
/// Errors: the `sched_setscheduler` error (`EPERM`, `EINVAL`); the caller logs it and runs on
/// with the policy the process had. On systems other than Linux it does nothing.
pub fn apply_to_process(policy: CpuScheduling) -> std::io::Result<()> {
    set_this_thread(policy)
}

/// Puts the calling thread back on the default policy (`SCHED_OTHER`), whatever the process's
/// policy: for the elector's thread (see the module doc). An error is logged, not returned: the
/// thread then keeps the process's policy.
pub fn keep_normal_on_this_thread() {
    if let Err(e) = set_this_thread(CpuScheduling::Normal) {
        tracing::warn!(error = %e, "the elector's thread keeps the process's scheduling policy");
    }
}

#[cfg(target_os = "linux")]
fn set_this_thread(policy: CpuScheduling) -> std::io::Result<()> {
    let policy = match policy {
        CpuScheduling::Batch => libc::SCHED_BATCH,
        CpuScheduling::Normal => libc::SCHED_OTHER,
    };
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid sched_param for the call's duration; pid 0 is the calling
    // thread (Linux applies the policy per thread).
    if unsafe { libc::sched_setscheduler(0, policy, &param) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn set_this_thread(_policy: CpuScheduling) -> std::io::Result<()> {
    Ok(())
}
