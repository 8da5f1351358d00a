//! The measurement code every system shares: HDR histograms of latencies, percentiles, rates,
//! and the benchmark payload that carries its send time.
//!
//! Latencies are recorded in microseconds (1 µs to 1 hour, 3 significant digits), the same
//! bounds as `bmqctl bench`, so figures of the probe and of `bmqctl` read alike.

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// First bytes of every probe payload.
const MAGIC: &[u8; 4] = b"PEER";
/// Magic + send time (u64 nanoseconds since the run's start, big-endian).
pub const HEADER_LEN: usize = 12;
/// Highest latency the histograms hold, microseconds (1 hour); larger values are clamped.
const LATENCY_MAX_US: u64 = 3_600_000_000;

/// An empty latency histogram (microseconds).
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, LATENCY_MAX_US, 3).expect("valid histogram bounds")
}

/// Records `d` (clamped to the histogram's bounds) into `h`.
pub fn record(h: &mut Histogram<u64>, d: Duration) {
    let us = (d.as_micros() as u64).clamp(1, LATENCY_MAX_US);
    h.record(us).expect("value within the histogram's bounds");
}

/// Latency percentiles of one histogram, milliseconds.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Percentiles {
    /// Samples recorded.
    pub count: u64,
    /// Median, ms.
    pub p50_ms: f64,
    /// 90th percentile, ms.
    pub p90_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// Largest sample, ms.
    pub max_ms: f64,
}

impl Percentiles {
    /// Reads the percentiles of `h` (all zero when it is empty).
    pub fn of(h: &Histogram<u64>) -> Percentiles {
        if h.is_empty() {
            return Percentiles::default();
        }
        let ms = |us: u64| us as f64 / 1000.0;
        Percentiles {
            count: h.len(),
            p50_ms: ms(h.value_at_quantile(0.50)),
            p90_ms: ms(h.value_at_quantile(0.90)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            max_ms: ms(h.max()),
        }
    }
}

/// `n / elapsed` per second, 0 for a zero duration.
pub fn rate(n: u64, elapsed: Duration) -> f64 {
    let secs = elapsed.as_secs_f64();
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// A payload of `filler.len()` bytes carrying `sent` (time since the run's start).
pub fn encode(filler: &[u8], sent: Duration) -> Bytes {
    let mut b = BytesMut::with_capacity(filler.len());
    b.put_slice(MAGIC);
    b.put_u64(sent.as_nanos() as u64);
    b.put_slice(&filler[HEADER_LEN..]);
    b.freeze()
}

/// The send time of a probe payload, or `None` if it is not one.
pub fn decode(payload: &[u8]) -> Option<Duration> {
    if payload.len() < HEADER_LEN || &payload[..4] != MAGIC {
        return None;
    }
    let nanos = u64::from_be_bytes(payload[4..12].try_into().ok()?);
    Some(Duration::from_nanos(nanos))
}

/// The `q` quantile (0..=1) of `samples` by the nearest-rank method; `None` when empty. Used
/// for the failover series, whose few samples do not need a histogram.
pub fn quantile(samples: &[f64], q: f64) -> Option<f64> {
    if samples.is_empty() {
        return None;
    }
    let mut s = samples.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let rank = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len());
    Some(s[rank - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_round_trip_and_rejects() {
        // A probe payload carries its send time; other payloads are rejected.
        let body = encode(&[0u8; 64], Duration::from_micros(1234));
        assert_eq!(body.len(), 64);
        assert_eq!(decode(&body), Some(Duration::from_micros(1234)));
        assert_eq!(decode(b"PEER"), None);
        assert_eq!(decode(&[0u8; 64]), None);
    }

    #[test]
    fn percentiles_of_known_samples() {
        // 1..=1000 µs: the median is 0.5 ms, the p99 0.99 ms.
        let mut h = histogram();
        for us in 1..=1000u64 {
            h.record(us).unwrap();
        }
        let p = Percentiles::of(&h);
        assert_eq!(
            (p.count, p.p50_ms, p.p99_ms, p.max_ms),
            (1000, 0.5, 0.99, 1.0)
        );
        assert_eq!(Percentiles::of(&histogram()), Percentiles::default());
    }

    #[test]
    fn nearest_rank_quantiles() {
        // Nearest rank: p50 of 1..=10 is 5, p99 is 10; one sample is every quantile.
        let s: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(quantile(&s, 0.5), Some(5.0));
        assert_eq!(quantile(&s, 0.99), Some(10.0));
        assert_eq!(quantile(&[7.0], 0.5), Some(7.0));
        assert_eq!(quantile(&[], 0.5), None);
    }
}
