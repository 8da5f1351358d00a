//! The longest single call of the duplicate window and of the index of outstanding messages
//! while they grow to 1,000,000+ GUIDs and shrink again (docs/bench/JOURNAL.md, "No stop-the-world
//! rehash"). A benchmark, not a test: it asserts nothing and is ignored by default.
//!
//! ```text
//! cargo test --release -p bmq-dataplane --lib pause_bench -- --ignored --nocapture
//! ```

use std::time::{Duration, Instant};

use crate::guid_index::GuidIndex;
use crate::guid_window::GuidWindow;

/// Times each call of `op(i)` for `i` in `range`; returns (total, longest, index of the
/// longest, calls over 1 ms).
fn time_each(
    range: std::ops::Range<u64>,
    mut op: impl FnMut(u64),
) -> (Duration, Duration, u64, usize) {
    let (mut total, mut worst, mut at, mut slow) = (Duration::ZERO, Duration::ZERO, 0, 0);
    for i in range {
        let t = Instant::now();
        op(i);
        let d = t.elapsed();
        total += d;
        slow += usize::from(d > Duration::from_millis(1));
        if d > worst {
            (worst, at) = (d, i);
        }
    }
    (total, worst, at, slow)
}

fn guid(n: u64) -> u128 {
    u128::from(n.wrapping_mul(0x9e37_79b9_7f4a_7c15)) << 64 | u128::from(n ^ 0x5851_f42d)
}

/// Prints the mean time per item (`n` items: GUIDs, or calls) and the longest call.
fn report(
    what: &str,
    n: u64,
    item: &str,
    (total, worst, at, slow): (Duration, Duration, u64, usize),
) {
    println!(
        "{what:<48} {n:>9} {item}s, {:>6.0} ns/{item}, longest call {:>9.3} ms (call {at}), {slow} calls over 1 ms",
        total.as_nanos() as f64 / n as f64,
        worst.as_secs_f64() * 1e3,
    );
}

#[test]
#[ignore]
fn pause_bench() {
    let t0 = Instant::now();
    let age = Duration::from_secs(3600);
    let mut w = GuidWindow::default();
    // The default window: 1,000,000 GUIDs; inserted 32 at a time (a partition's finished
    // messages arrive in groups, one per journal sync) and expired after each group, as
    // `ReplicationCore` does.
    const GROUP: u64 = 32;
    let mut insert = |g: u64| {
        w.insert_all(t0, (g * GROUP..(g + 1) * GROUP).map(guid));
        w.expire(t0, 1_000_000, age);
    };
    let n = 1_000_000;
    report(
        "window: insert 32 + expire, growing to 1M",
        n,
        "GUID",
        time_each(0..n / GROUP, &mut insert),
    );
    report(
        "window: insert 32 + expire, full at 1M",
        2 * n,
        "GUID",
        time_each(n / GROUP..3 * n / GROUP, &mut insert),
    );
    let calls = 1_000_000u64.div_ceil(crate::guid_window::AGE_OUT_PER_CALL as u64);
    report(
        "window: 1M age out (calls of a timer)",
        calls,
        "call",
        time_each(0..calls, |_| w.expire(t0 + age * 2, 1_000_000, age)),
    );
    let mut index: GuidIndex<[u64; 4]> = GuidIndex::new();
    let n = 1_500_000;
    report(
        "index: insert to 1.5M (a backlog builds)",
        n,
        "GUID",
        time_each(0..n, |i| index.insert_new(guid(i), [i; 4])),
    );
    report(
        "index: remove all (the backlog drains)",
        n,
        "GUID",
        time_each(0..n, |i| {
            index.remove(guid(i));
        }),
    );
    // As a replica indexes a batch of replicated records: the buckets of 32 loaded first.
    let mut index: GuidIndex<[u64; 4]> = GuidIndex::new();
    report(
        "index: insert to 1.5M, 32 at a time, prefetched",
        n,
        "GUID",
        time_each(0..n / GROUP, |g| {
            let loaded = (g * GROUP..(g + 1) * GROUP).fold(0, |l, i| l ^ index.prefetch(guid(i)));
            std::hint::black_box(loaded);
            for i in g * GROUP..(g + 1) * GROUP {
                index.insert_new(guid(i), [i; 4]);
            }
        }),
    );
}
