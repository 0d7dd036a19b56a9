//! Jittered exponential backoff for reconnects, and the pace of one tunnel
//! connection's retries ([`Pace`]): fast probes while the edge's address does
//! not answer, the backoff when it answers "not now".

use std::time::{Duration, Instant};

use super::connect::ConnectError;
use crate::constants::{
    BACKOFF_INITIAL, BACKOFF_MAX, BACKOFF_RESET_AFTER, PROBE_INTERVAL, PROBE_SLOW_AFTER, PROBE_SLOW_INTERVAL,
    RETRY_AFTER_MAX,
};

/// Delays double from [`BACKOFF_INITIAL`] up to [`BACKOFF_MAX`]; each is
/// drawn uniformly from its upper half so that many agents do not reconnect
/// in lockstep after an edge restart.
#[derive(Debug, Clone)]
pub struct Backoff {
    attempt: u32,
    initial: Duration,
    max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff::new(BACKOFF_INITIAL, BACKOFF_MAX)
    }
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        Backoff { attempt: 0, initial, max }
    }

    /// The next delay.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.initial.saturating_mul(1u32 << self.attempt.min(20)).min(self.max);
        self.attempt = self.attempt.saturating_add(1);
        let half = ceiling / 2;
        half + half.mul_f64(random_unit())
    }

    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// When one tunnel connection tries again.
///
/// - Nothing answers at the address (refused, reset, timed out: the edge is
///   down or restarting): a probe every [`PROBE_INTERVAL`] ± a third, so the
///   agent is back within one interval of the edge; [`PROBE_SLOW_INTERVAL`]
///   after [`PROBE_SLOW_AFTER`] of silence. The backoff does not grow.
/// - The edge answered and refused (429, 503, a bad key, a TLS failure): the
///   doubling [`Backoff`], at least the edge's `Retry-After`.
/// - A connection that was up and ended: the backoff (reset when it lived
///   [`BACKOFF_RESET_AFTER`]), so an edge that keeps closing is not hammered.
#[derive(Debug, Clone, Default)]
pub struct Pace {
    backoff: Backoff,
    /// Since when nothing answers.
    unreachable_since: Option<Instant>,
}

/// What [`Pace`] decided about a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retry {
    pub delay: Duration,
    /// A probe of an address that did not answer (not a backoff).
    pub probe: bool,
    /// The first failure of its kind in a row (worth a warning; repeats are debug).
    pub first: bool,
}

impl Pace {
    /// After a connection attempt failed with `e`.
    pub fn failed(&mut self, e: &ConnectError) -> Retry {
        if e.is_unreachable() {
            let first = self.unreachable_since.is_none();
            let since = *self.unreachable_since.get_or_insert_with(Instant::now);
            let interval =
                if since.elapsed() < PROBE_SLOW_AFTER { PROBE_INTERVAL } else { PROBE_SLOW_INTERVAL };
            // Uniform in [2/3, 4/3] of the interval: agents do not probe in lockstep.
            let delay = interval.mul_f64(2.0 / 3.0 + random_unit() * 2.0 / 3.0);
            return Retry { delay, probe: true, first };
        }
        let first = self.unreachable_since.take().is_some() || self.backoff.attempt == 0;
        let mut delay = self.backoff.next_delay();
        if let Some(asked) = e.retry_after() {
            delay = delay.max(asked.min(RETRY_AFTER_MAX));
        }
        Retry { delay, probe: false, first }
    }

    /// After a connection that was up for `lived` ended.
    pub fn lost(&mut self, lived: Duration) -> Duration {
        self.unreachable_since = None;
        if lived >= BACKOFF_RESET_AFTER {
            self.backoff.reset();
        }
        self.backoff.next_delay()
    }
}

/// A random number in [0, 1).
fn random_unit() -> f64 {
    match crate::random_bytes::<4>() {
        Ok(b) => u32::from_le_bytes(b) as f64 / (u32::MAX as f64 + 1.0),
        Err(_) => 0.5,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_jittered_and_capped() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let d: Vec<_> = (0..10).map(|_| b.next_delay()).collect();
        assert!(d[0] >= Duration::from_millis(50) && d[0] <= Duration::from_millis(100));
        assert!(d[3] >= Duration::from_millis(400) && d[3] <= Duration::from_millis(800));
        for x in &d[5..] {
            assert!(*x >= Duration::from_secs(1) && *x <= Duration::from_secs(2), "{x:?}");
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }

    #[test]
    fn probes_while_nothing_answers_and_backs_off_on_refusals() {
        use std::io::{Error, ErrorKind};
        let refused_tcp =
            ConnectError::Dial { addr: "e".into(), source: Error::from(ErrorKind::ConnectionRefused) };
        let busy = |retry_after| ConnectError::Refused {
            status: 503,
            code: "x".into(),
            message: "x".into(),
            retry_after,
        };
        let mut pace = Pace::default();
        // Probes: short and flat, however many.
        for i in 0..50 {
            let r = pace.failed(&refused_tcp);
            assert!(r.probe && r.first == (i == 0), "{r:?}");
            assert!(r.delay >= Duration::from_millis(100) && r.delay <= Duration::from_millis(200), "{r:?}");
        }
        // "Not now": the backoff grows, and Retry-After is honoured.
        let delays: Vec<_> = (0..6).map(|_| pace.failed(&busy(None))).collect();
        assert!(delays[0].first && !delays[0].probe && !delays[1].first);
        assert!(delays[5].delay >= Duration::from_millis(1600), "{delays:?}");
        assert!(pace.failed(&busy(Some(Duration::from_secs(90)))).delay >= Duration::from_secs(90));
        // A huge one is capped (the backoff itself stays below the cap).
        assert_eq!(pace.failed(&busy(Some(Duration::from_secs(86_400)))).delay, RETRY_AFTER_MAX);
        // A long-lived connection resets the backoff.
        assert!(pace.lost(BACKOFF_RESET_AFTER) <= BACKOFF_INITIAL);
    }
}
