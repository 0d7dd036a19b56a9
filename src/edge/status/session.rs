//! Login sessions of the status page on the public port.
//!
//! A session is 32 random bytes, given to the browser once as the cookie
//! [`COOKIE`] (`__Host-`: Secure, no Domain, Path=/; HttpOnly;
//! SameSite=Strict, so no other site's page can send it) and kept in memory
//! as their SHA-256 only, with the admin key it was opened with. A session
//! ends after [`LIFETIME`], on logout, on restart, and as soon as its key is
//! revoked. At most [`MAX_SESSIONS`]; a new login ends the oldest.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use http::HeaderMap;
use http::header;
use ring::rand::SecureRandom;

/// The cookie's name.
pub const COOKIE: &str = "__Host-culvert-status";
/// How long a login lasts.
pub const LIFETIME: Duration = Duration::from_secs(12 * 3600);
/// Sessions kept at most.
pub const MAX_SESSIONS: usize = 64;

struct Session {
    key_id: String,
    expires: Instant,
}

#[derive(Default)]
pub struct Sessions {
    by_hash: Mutex<HashMap<[u8; 32], Session>>,
}

fn hash(token: &str) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    d.as_ref().try_into().expect("SHA-256 is 32 bytes")
}

impl Sessions {
    /// Opens a session for the admin key `key_id`; returns the token.
    pub fn open(&self, key_id: &str) -> String {
        let mut raw = [0u8; 32];
        ring::rand::SystemRandom::new().fill(&mut raw).expect("system randomness");
        let token: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        let now = Instant::now();
        let mut map = self.by_hash.lock().expect("poisoned");
        map.retain(|_, s| s.expires > now);
        while map.len() >= MAX_SESSIONS {
            let oldest = map.iter().min_by_key(|(_, s)| s.expires).map(|(h, _)| *h).expect("not empty");
            map.remove(&oldest);
        }
        map.insert(hash(&token), Session { key_id: key_id.to_string(), expires: now + LIFETIME });
        token
    }

    /// The admin key id of the session in `headers`' cookie, if it is open.
    pub fn key_of(&self, headers: &HeaderMap) -> Option<String> {
        let token = cookie(headers)?;
        let mut map = self.by_hash.lock().expect("poisoned");
        let h = hash(&token);
        match map.get(&h) {
            Some(s) if s.expires > Instant::now() => Some(s.key_id.clone()),
            Some(_) => {
                map.remove(&h);
                None
            }
            None => None,
        }
    }

    /// Ends the session in `headers`' cookie.
    pub fn close(&self, headers: &HeaderMap) {
        if let Some(token) = cookie(headers) {
            self.by_hash.lock().expect("poisoned").remove(&hash(&token));
        }
    }

    /// Ends every session of a key (it was revoked, or is no admin key any more).
    pub fn close_key(&self, key_id: &str) {
        self.by_hash.lock().expect("poisoned").retain(|_, s| s.key_id != key_id);
    }

    /// The admin keys of the open sessions.
    pub fn key_ids(&self) -> std::collections::HashSet<String> {
        self.by_hash.lock().expect("poisoned").values().map(|s| s.key_id.clone()).collect()
    }

    pub fn len(&self) -> usize {
        self.by_hash.lock().expect("poisoned").len()
    }
}

/// The session token in the `Cookie` headers.
fn cookie(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.trim().to_string())
        .filter(|v| v.len() == 64 && v.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// `Set-Cookie` for a new session.
pub fn set_cookie(token: &str) -> String {
    format!("{COOKIE}={token}; Path=/; Max-Age={}; HttpOnly; Secure; SameSite=Strict", LIFETIME.as_secs())
}

/// `Set-Cookie` that removes the session cookie.
pub fn clear_cookie() -> String {
    format!("{COOKIE}=; Path=/; Max-Age=0; HttpOnly; Secure; SameSite=Strict")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_cookie(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::COOKIE, v.parse().unwrap());
        h
    }

    #[test]
    fn sessions_open_close_and_are_bounded() {
        let s = Sessions::default();
        let t = s.open("ak_1");
        assert_eq!(t.len(), 64);
        let h = with_cookie(&format!("other=1; {COOKIE}={t}"));
        assert_eq!(s.key_of(&h).as_deref(), Some("ak_1"));
        assert_eq!(s.key_of(&with_cookie(&format!("{COOKIE}={}", "0".repeat(64)))), None);
        assert_eq!(s.key_of(&with_cookie(&format!("{COOKIE}=ak_1"))), None, "not a token");
        s.close(&h);
        assert_eq!(s.key_of(&h), None);
        for _ in 0..MAX_SESSIONS + 10 {
            s.open("ak_2");
        }
        assert_eq!(s.len(), MAX_SESSIONS);
        let t = s.open("ak_3");
        s.close_key("ak_2");
        assert_eq!(s.len(), 1);
        assert_eq!(s.key_of(&with_cookie(&format!("{COOKIE}={t}"))).as_deref(), Some("ak_3"));
        assert!(set_cookie(&t).contains("HttpOnly; Secure; SameSite=Strict"));
    }
}
