//! Who scouts first after the leader is lost: a pure decision with its own tests.
//!
//! The BlazingMQ article has every follower that lost its leader wait "a random interval" before
//! its `ElectionScouting`, so that the followers do not all scout at once. With a random wait in
//! `[0, random_wait_max]` the cluster waits for the *smallest* draw, and two close draws make two
//! scoutings race. Here the survivors take turns instead: each ranks itself among the nodes it
//! believes survived (itself and its available peers, the lost leader excluded) by node id, and
//! the lowest id scouts almost at once (10-30 ms by default) while the others wait in later, disjoint windows, still
//! within `random_wait_max`. Nothing else changes: the scouting, the sticky leader, the term
//! rules and the votes are the article's, so the ranks only decide *when* a node may try; a node
//! whose view of the survivors is wrong (two nodes that both rank first) only scouts at about the
//! same time as another, which the protocol already tolerates (one of them fails, waits a random
//! interval and retries).

use std::time::Duration;

/// The first successor's window is `[max / FIRST_WINDOW_START_DIVISOR, max /
/// FIRST_WINDOW_END_DIVISOR]`, 10-30 ms by default. A little randomness remains so that two nodes
/// that both believe they rank first do not scout in lock step. It does not start at 0 because
/// the other survivors must have seen the loss too, or they answer the scouting `No` (sticky
/// leader) and it fails only at its timeout: followers of a silent leader drop it at their own
/// heartbeat deadlines, which differ by the spread of the last heartbeat's arrival (the
/// failover benchmark caught a silent-leader run failing its first scouting that way with a
/// window starting at 0: docs/bench/JOURNAL.md, "Failover").
const FIRST_WINDOW_START_DIVISOR: u32 = 30;
/// See [`FIRST_WINDOW_START_DIVISOR`].
const FIRST_WINDOW_END_DIVISOR: u32 = 10;

/// The window `(min, max)` (inclusive) from which a follower that lost its leader draws its wait
/// before scouting, given its `rank` among `survivors` nodes (itself included; rank 0 is the
/// lowest node id among them) and the configured `random_wait_max`.
///
/// - rank 0: `[random_wait_max / 30, random_wait_max / 10]`;
/// - rank `r >= 1` of `k` survivors: the `r`-th of `k - 1` equal slices of
///   `[random_wait_max / 2, random_wait_max]`, so a later rank never scouts before an earlier
///   rank's window has passed, and nobody waits longer than `random_wait_max` (the bound the
///   article's random wait had; the liveness bounds of the simulator still hold);
/// - `random_wait_max == 0`: `(0, 0)` for every rank (the model checker's setting).
///
/// A `rank` at or above `survivors` (a caller's inconsistency) is treated as the last rank.
pub fn successor_wait_bounds(
    rank: usize,
    survivors: usize,
    random_wait_max: Duration,
) -> (Duration, Duration) {
    if rank == 0 || survivors <= 1 {
        return (
            random_wait_max / FIRST_WINDOW_START_DIVISOR,
            random_wait_max / FIRST_WINDOW_END_DIVISOR,
        );
    }
    let later = (survivors - 1) as u32;
    let rank = rank.min(survivors - 1) as u32;
    let half = random_wait_max / 2;
    let slice = (random_wait_max - half) / later;
    let low = half + slice * (rank - 1);
    let high = if rank == later {
        random_wait_max
    } else {
        half + slice * rank
    };
    (low, high)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    /// Three nodes (two survivors) with the default 300 ms: the first scouts within 10-30 ms,
    /// the second from 150 to 300 ms.
    #[test]
    fn two_survivors_take_turns() {
        assert_eq!(successor_wait_bounds(0, 2, ms(300)), (ms(10), ms(30)));
        assert_eq!(successor_wait_bounds(1, 2, ms(300)), (ms(150), ms(300)));
    }

    /// Five nodes (four survivors): the later ranks split [150, 300] ms into disjoint slices in
    /// rank order, the last one ending at random_wait_max.
    #[test]
    fn later_ranks_get_disjoint_slices_in_order() {
        let w = ms(300);
        let bounds: Vec<_> = (0..4).map(|r| successor_wait_bounds(r, 4, w)).collect();
        assert_eq!(
            bounds,
            vec![
                (ms(10), ms(30)),
                (ms(150), ms(200)),
                (ms(200), ms(250)),
                (ms(250), ms(300)),
            ]
        );
        for pair in bounds.windows(2) {
            assert!(pair[0].1 <= pair[1].0, "windows overlap: {pair:?}");
        }
    }

    /// No randomness configured: every rank scouts at once (the model checker relies on it).
    #[test]
    fn zero_max_gives_zero_waits() {
        for (rank, survivors) in [(0, 1), (0, 2), (1, 2), (3, 4), (9, 4)] {
            assert_eq!(
                successor_wait_bounds(rank, survivors, Duration::ZERO),
                (Duration::ZERO, Duration::ZERO)
            );
        }
    }

    /// Never beyond random_wait_max, whatever the rank (even an inconsistent one).
    #[test]
    fn never_beyond_random_wait_max() {
        for survivors in 1..8 {
            for rank in 0..10 {
                let (low, high) = successor_wait_bounds(rank, survivors, ms(300));
                assert!(
                    low <= high && high <= ms(300),
                    "{rank}/{survivors}: {low:?}..{high:?}"
                );
            }
        }
    }
}
