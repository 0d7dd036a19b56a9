//! Per-tunnel request counters (a few atomics, bumped on the data path) and
//! the rolling traffic history the status page draws: one sample per
//! [`INTERVAL`], [`POINTS`] kept, only for tunnels that carried something in
//! the window (an idle reservation costs nothing), at most [`MAX_TUNNELS`].

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::StatusCode;

use super::model::{History, Rates, Totals};

/// Seconds per history entry.
pub const INTERVAL: Duration = Duration::from_secs(5);
/// History entries kept (5 minutes).
pub const POINTS: usize = 60;
/// Most tunnels with a history; beyond, the quietest are dropped.
pub const MAX_TUNNELS: usize = 1000;

/// Requests and their outcome for one reservation (bytes are counted by the
/// `bytes` metric). Relaxed atomics: cheap on the data path.
#[derive(Debug, Default)]
pub struct TunnelCounters {
    requests: AtomicU64,
    errors_4xx: AtomicU64,
    errors_5xx: AtomicU64,
    offline: AtomicU64,
}

impl TunnelCounters {
    /// A request (HTTP) or connection (TCP, TLS) arrived.
    pub fn request(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// The answer's status (from the backend or the edge).
    pub fn answered(&self, status: StatusCode) {
        if status.is_client_error() {
            self.errors_4xx.fetch_add(1, Ordering::Relaxed);
        } else if status.is_server_error() {
            self.errors_5xx.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// No agent was connected ("tunnel offline").
    pub fn offline(&self) {
        self.offline.fetch_add(1, Ordering::Relaxed);
    }

    /// The counts now, with the byte counts given.
    pub fn totals(&self, bytes_in: u64, bytes_out: u64) -> Totals {
        Totals {
            requests: self.requests.load(Ordering::Relaxed),
            bytes_in,
            bytes_out,
            errors4xx: self.errors_4xx.load(Ordering::Relaxed),
            errors5xx: self.errors_5xx.load(Ordering::Relaxed),
            offline: self.offline.load(Ordering::Relaxed),
        }
    }
}

fn errors(t: &Totals) -> u64 {
    t.errors4xx + t.errors5xx + t.offline
}

/// One interval's counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Sample {
    requests: u64,
    bytes_in: u64,
    bytes_out: u64,
    errors: u64,
}

impl Sample {
    fn between(before: &Totals, now: &Totals) -> Sample {
        Sample {
            requests: now.requests.saturating_sub(before.requests),
            bytes_in: now.bytes_in.saturating_sub(before.bytes_in),
            bytes_out: now.bytes_out.saturating_sub(before.bytes_out),
            errors: errors(now).saturating_sub(errors(before)),
        }
    }

    fn is_zero(&self) -> bool {
        *self == Sample::default()
    }

    fn weight(&self) -> u64 {
        self.requests.saturating_add(self.bytes_in).saturating_add(self.bytes_out)
    }
}

struct Track {
    last: Totals,
    samples: VecDeque<Sample>,
}

/// The histories by tunnel name, and the totals of the last sample of each
/// tunnel (to take differences from).
#[derive(Default)]
pub struct Histories {
    tracks: Mutex<HashMap<String, Track>>,
}

impl Histories {
    /// Takes one sample of every tunnel's `totals` (called every [`INTERVAL`]).
    pub fn sample(&self, totals: impl IntoIterator<Item = (String, Totals)>) {
        let mut tracks = self.tracks.lock().expect("poisoned");
        let mut seen = std::collections::HashSet::new();
        for (name, now) in totals {
            seen.insert(name.clone());
            match tracks.get_mut(&name) {
                Some(track) => {
                    let s = Sample::between(&track.last, &now);
                    track.last = now;
                    if track.samples.is_empty() && s.is_zero() {
                        continue; // quiet: no history kept
                    }
                    if track.samples.len() == POINTS {
                        track.samples.pop_front();
                    }
                    track.samples.push_back(s);
                }
                None => {
                    // The first sample: what happened since the edge started is in
                    // the totals, not in this window.
                    tracks.insert(name, Track { last: now, samples: VecDeque::new() });
                }
            }
        }
        // Counters that are gone are forgotten; a history quiet for the whole
        // window is dropped.
        tracks.retain(|name, _| seen.contains(name));
        for t in tracks.values_mut() {
            if t.samples.len() == POINTS && t.samples.iter().all(Sample::is_zero) {
                t.samples = VecDeque::new();
            }
        }
        let mut busy: Vec<(u64, String)> = tracks
            .iter()
            .filter(|(_, t)| !t.samples.is_empty())
            .map(|(n, t)| (t.samples.iter().map(Sample::weight).fold(0, u64::saturating_add), n.clone()))
            .collect();
        if busy.len() > MAX_TUNNELS {
            busy.sort();
            let quietest = busy.len() - MAX_TUNNELS;
            for (_, name) in busy.into_iter().take(quietest) {
                if let Some(t) = tracks.get_mut(&name) {
                    t.samples = VecDeque::new();
                }
            }
        }
    }

    /// A tunnel's history and its rates over the last interval.
    pub fn of(&self, name: &str) -> (History, Rates) {
        let tracks = self.tracks.lock().expect("poisoned");
        let mut h = History { interval_seconds: INTERVAL.as_secs(), points: POINTS, ..History::default() };
        let Some(track) = tracks.get(name) else { return (h, Rates::default()) };
        for s in &track.samples {
            h.requests.push(s.requests);
            h.bytes_in.push(s.bytes_in);
            h.bytes_out.push(s.bytes_out);
            h.errors.push(s.errors);
        }
        let last = track.samples.back().copied().unwrap_or_default();
        let per_s = |n: u64| n as f64 / INTERVAL.as_secs_f64();
        let rates = Rates {
            requests: per_s(last.requests),
            bytes_in: per_s(last.bytes_in),
            bytes_out: per_s(last.bytes_out),
            errors: per_s(last.errors),
        };
        (h, rates)
    }

    /// The traffic of a tunnel in the window (for ordering the list).
    pub fn weight(&self, name: &str) -> u64 {
        let tracks = self.tracks.lock().expect("poisoned");
        tracks.get(name).map_or(0, |t| t.samples.iter().map(Sample::weight).fold(0, u64::saturating_add))
    }

    /// Tunnels with a history now.
    pub fn len(&self) -> usize {
        self.tracks.lock().expect("poisoned").values().filter(|t| !t.samples.is_empty()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(requests: u64, bytes_in: u64) -> Totals {
        Totals { requests, bytes_in, ..Totals::default() }
    }

    #[test]
    fn counts_outcomes() {
        let c = TunnelCounters::default();
        c.request();
        c.request();
        c.answered(StatusCode::OK);
        c.answered(StatusCode::NOT_FOUND);
        c.answered(StatusCode::BAD_GATEWAY);
        c.offline();
        let t = c.totals(3, 4);
        assert_eq!(
            (t.requests, t.errors4xx, t.errors5xx, t.offline, t.bytes_in, t.bytes_out),
            (2, 1, 1, 1, 3, 4)
        );
    }

    #[test]
    fn history_is_rolling_and_bounded() {
        let h = Histories::default();
        h.sample([("a".to_string(), t(10, 100))]);
        assert!(h.of("a").0.requests.is_empty(), "the first sample only sets the base");
        for i in 1..=(POINTS as u64 + 5) {
            h.sample([("a".to_string(), t(10 + i, 100 + 2 * i))]);
        }
        let (hist, rates) = h.of("a");
        assert_eq!(hist.requests.len(), POINTS, "bounded");
        assert!(hist.requests.iter().all(|&n| n == 1));
        assert!(hist.bytes_in.iter().all(|&n| n == 2));
        assert_eq!(rates.requests, 1.0 / INTERVAL.as_secs_f64());
        // Quiet for a whole window: forgotten.
        for _ in 0..POINTS {
            h.sample([("a".to_string(), t(10 + POINTS as u64 + 5, 0))]);
        }
        assert!(h.of("a").0.requests.is_empty(), "a quiet window is dropped");
        assert_eq!(h.weight("a"), 0);
        // Gone from the counters: forgotten.
        h.sample([("b".to_string(), t(1, 1))]);
        h.sample([("b".to_string(), t(2, 1))]);
        assert_eq!(h.len(), 1);
        h.sample([]);
        assert_eq!(h.len(), 0);
        assert!(h.tracks.lock().unwrap().is_empty());
    }

    #[test]
    fn at_most_max_tunnels() {
        let h = Histories::default();
        let all = |k: u64| (0..MAX_TUNNELS as u64 + 50).map(move |i| (format!("t{i}"), t(i * k, 0)));
        h.sample(all(0));
        h.sample(all(1));
        assert_eq!(h.len(), MAX_TUNNELS);
        assert!(h.weight("t0") == 0 && h.of("t0").0.requests.is_empty(), "the quietest are dropped");
        assert_eq!(h.weight(&format!("t{}", MAX_TUNNELS + 49)), MAX_TUNNELS as u64 + 49);
    }
}
