//! Elector timing and quorum settings (DESIGN.md §4), with their validation.

use std::time::Duration;

/// Timing and quorum settings of one elector.
///
/// Defaults are tuned for sub-second failover (DESIGN.md §4); BlazingMQ's own defaults are given
/// on each field for comparison. Relations checked by [`ElectorConfig::validate`]:
/// `heartbeat_check_period <= heartbeat_period`, every period and timeout `> 0`,
/// `heartbeat_miss_count >= 1`. A silent leader is detected after
/// `heartbeat_miss_count * heartbeat_period` (plus at most one `heartbeat_check_period`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ElectorConfig {
    /// How long a starting node waits to discover an existing leader before it scouts
    /// (default 500 ms; BlazingMQ 8 s). Ignored (treated as 0) on a node without peers.
    pub initial_wait: Duration,
    /// Upper bound of the random wait before each ElectionScouting, so that followers that lost
    /// their leader together do not scout together (the article's "random interval"; default
    /// 300 ms; BlazingMQ 3 s). Sampled with 1 ms granularity; 0 disables the randomness. After
    /// the loss of a leader, the survivors draw from disjoint windows within this bound in
    /// node-id order instead ([`crate::successor_wait_bounds`]), so the first scouts within
    /// a thirtieth to a tenth of it.
    pub random_wait_max: Duration,
    /// How long a scouting node waits for a quorum of `will_vote = true` answers (default
    /// 500 ms; BlazingMQ 4 s).
    pub scouting_result_timeout: Duration,
    /// How long a candidate waits for a quorum of `ElectionResponse`s (default 500 ms;
    /// BlazingMQ 4 s).
    pub election_result_timeout: Duration,
    /// Period of the leader's `LeaderHeartbeat` broadcast (default 100 ms; BlazingMQ 2 s).
    pub heartbeat_period: Duration,
    /// Period at which a follower checks for missed heartbeats (default 50 ms; BlazingMQ 1 s).
    pub heartbeat_check_period: Duration,
    /// A follower drops its leader after `heartbeat_miss_count * heartbeat_period` without a
    /// heartbeat (default 8; BlazingMQ 10).
    pub heartbeat_miss_count: u32,
    /// Number of nodes (self included) whose support makes or keeps a leader. `0` means a
    /// majority, `N/2 + 1` with `N` the cluster size. A value above `N` is allowed and forbids
    /// leadership (used by tests and by operators draining a cluster).
    pub quorum: usize,
}

impl Default for ElectorConfig {
    fn default() -> Self {
        ElectorConfig {
            initial_wait: Duration::from_millis(500),
            random_wait_max: Duration::from_millis(300),
            scouting_result_timeout: Duration::from_millis(500),
            election_result_timeout: Duration::from_millis(500),
            heartbeat_period: Duration::from_millis(100),
            heartbeat_check_period: Duration::from_millis(50),
            heartbeat_miss_count: 8,
            quorum: 0,
        }
    }
}

/// Why an [`ElectorConfig`] was refused at start-up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A period or timeout that must be positive is zero.
    #[error("elector setting {field} must be greater than 0")]
    ZeroDuration {
        /// The setting's name, as in the configuration file.
        field: &'static str,
    },
    /// Checking for heartbeats less often than they are sent delays leader-loss detection.
    #[error(
        "elector heartbeat_check_period ({check_period:?}) must be <= heartbeat_period ({period:?})"
    )]
    HeartbeatCheckTooSlow {
        /// The configured `heartbeat_check_period`.
        check_period: Duration,
        /// The configured `heartbeat_period`.
        period: Duration,
    },
    /// A miss count of zero would drop the leader at once.
    #[error("elector heartbeat_miss_count must be >= 1, got {miss_count}")]
    HeartbeatMissCountZero {
        /// The configured `heartbeat_miss_count`.
        miss_count: u32,
    },
}

impl ElectorConfig {
    /// Checks the relations documented on [`ElectorConfig`].
    ///
    /// # Errors
    /// The first violated relation, naming the field(s) and values.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, value) in [
            ("scouting_result_timeout", self.scouting_result_timeout),
            ("election_result_timeout", self.election_result_timeout),
            ("heartbeat_period", self.heartbeat_period),
            ("heartbeat_check_period", self.heartbeat_check_period),
        ] {
            if value.is_zero() {
                return Err(ConfigError::ZeroDuration { field });
            }
        }
        if self.heartbeat_check_period > self.heartbeat_period {
            return Err(ConfigError::HeartbeatCheckTooSlow {
                check_period: self.heartbeat_check_period,
                period: self.heartbeat_period,
            });
        }
        if self.heartbeat_miss_count == 0 {
            return Err(ConfigError::HeartbeatMissCountZero {
                miss_count: self.heartbeat_miss_count,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The defaults are DESIGN.md §4's table and pass validation.
    #[test]
    fn defaults_match_design_and_validate() {
        let c = ElectorConfig::default();
        assert_eq!(c.initial_wait, Duration::from_millis(500));
        assert_eq!(c.random_wait_max, Duration::from_millis(300));
        assert_eq!(c.scouting_result_timeout, Duration::from_millis(500));
        assert_eq!(c.election_result_timeout, Duration::from_millis(500));
        assert_eq!(c.heartbeat_period, Duration::from_millis(100));
        assert_eq!(c.heartbeat_check_period, Duration::from_millis(50));
        assert_eq!(c.heartbeat_miss_count, 8);
        assert_eq!(c.quorum, 0);
        assert_eq!(c.validate(), Ok(()));
    }

    /// Each broken relation is refused with the field and values named.
    #[test]
    fn invalid_settings_are_refused() {
        let c = ElectorConfig {
            heartbeat_period: Duration::ZERO,
            ..Default::default()
        };
        assert_eq!(
            c.validate(),
            Err(ConfigError::ZeroDuration {
                field: "heartbeat_period"
            })
        );

        let c = ElectorConfig {
            heartbeat_check_period: Duration::from_millis(200),
            ..Default::default()
        };
        let err = c.validate().unwrap_err();
        assert_eq!(
            err,
            ConfigError::HeartbeatCheckTooSlow {
                check_period: Duration::from_millis(200),
                period: Duration::from_millis(100)
            }
        );
        assert!(err.to_string().contains("heartbeat_check_period (200ms)"));

        let c = ElectorConfig {
            heartbeat_miss_count: 0,
            ..Default::default()
        };
        assert_eq!(
            c.validate(),
            Err(ConfigError::HeartbeatMissCountZero { miss_count: 0 })
        );

        let c = ElectorConfig {
            random_wait_max: Duration::ZERO,
            initial_wait: Duration::ZERO,
            ..Default::default()
        };
        assert_eq!(c.validate(), Ok(()));
    }
}
