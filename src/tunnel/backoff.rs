//! Jittered exponential backoff for reconnects.

use std::time::Duration;

use crate::constants::{BACKOFF_INITIAL, BACKOFF_MAX};

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
}
