//! The routing of an HTTP tunnel, free of IO: which backend a request goes
//! to (the Kubernetes Ingress rules, and Gateway API's HTTPRoute matches),
//! and how the paths several Ingresses give one host are merged.
//!
//! Matching, as the Ingress API and Gateway API define it:
//! - `Exact`: the request path equals the rule's path (case-sensitive);
//! - `Prefix`: element-wise on `/`: `/foo` (or `/foo/`) matches `/foo`,
//!   `/foo/` and `/foo/bar`, never `/foobar`; `/` matches every path;
//! - a rule's [`Conditions`] (method, headers, query parameters, hosts)
//!   must all hold too;
//! - of the rules that match, a rule whose `hosts` name the request's host
//!   exactly wins, then the longest matching wildcard, then the rules
//!   without hosts (Gateway API: hostnames before paths); then, among those:
//! - of the rules that match, the longest path wins, `Exact` before `Prefix`
//!   at equal length (so an `Exact` match always wins: a prefix that matches
//!   the same path is never longer), then a rule with a method, then the
//!   most header matches, then the most query parameter matches, then the
//!   first given (a stable sort): Gateway API's precedence;
//! - no rule matches: the default backend, or nothing (404).

use std::collections::BTreeMap;
use std::fmt;

use http::{HeaderMap, Method};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::crd::{MatchType, PathType, ServiceRef, ValueMatch};

/// The most a compiled regular expression of a match may take (a tenant's
/// pattern runs in every agent replica).
const REGEX_SIZE_LIMIT: usize = 256 * 1024;

/// A regular expression that must match a whole value; compares by its text.
#[derive(Debug, Clone)]
pub struct Pattern(regex::Regex);

impl PartialEq for Pattern {
    fn eq(&self, other: &Self) -> bool {
        self.0.as_str() == other.0.as_str()
    }
}

impl Eq for Pattern {}

impl Pattern {
    /// Compiles `pattern` (Rust `regex` syntax), anchored at both ends.
    pub fn new(pattern: &str) -> Result<Pattern, String> {
        regex::RegexBuilder::new(&format!("^(?:{pattern})$"))
            .size_limit(REGEX_SIZE_LIMIT)
            .dfa_size_limit(REGEX_SIZE_LIMIT)
            .build()
            .map(Pattern)
            .map_err(|e| match e {
                regex::Error::CompiledTooBig(_) => format!("regular expression `{pattern}` is too large"),
                e => format!("`{pattern}` is not a regular expression: {}", first_line(&e.to_string())),
            })
    }

    fn is_match(&self, value: &str) -> bool {
        self.0.is_match(value)
    }
}

fn first_line(s: &str) -> String {
    // The regex crate's messages draw the pattern over several lines.
    let last = s.lines().map(str::trim).rfind(|l| !l.is_empty()).unwrap_or(s);
    last.strip_prefix("error: ").unwrap_or(last).to_string()
}

/// How a value is compared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Matcher {
    Exact(String),
    Regex(Pattern),
}

impl Matcher {
    fn is_match(&self, value: &str) -> bool {
        match self {
            Matcher::Exact(v) => v == value,
            Matcher::Regex(p) => p.is_match(value),
        }
    }
}

/// One header (name lower-cased) or query parameter a request must carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValueMatcher {
    pub name: String,
    pub value: Matcher,
}

/// What besides its path a request must have for a rule to match (Gateway
/// API's `HTTPRouteMatch`): all of it must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Conditions {
    pub method: Option<Method>,
    pub headers: Vec<ValueMatcher>,
    pub query: Vec<ValueMatcher>,
    /// The request's host must be one of these (none: any host).
    pub hosts: Vec<HostMatch>,
}

/// One of a rule's `hosts`, as Gateway API matches hostnames: an exact name,
/// or `*.suffix` (one label or more before `.suffix`, never `suffix` itself);
/// lower case, no trailing dot; the request's port does not count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostMatch {
    Exact(String),
    /// The suffix with its leading dot (`.example.com`).
    Wildcard(String),
}

/// How specific a rule's host match is for one request (greater wins):
/// an exact name before a wildcard, a longer wildcard before a shorter one,
/// and a rule without hosts last.
pub type HostRank = (bool, usize);

impl HostMatch {
    /// Parses a `hosts` entry: a host name (`app.example.com`) or a wildcard
    /// (`*.example.com`); IP addresses, ports and other wildcards are refused.
    pub fn parse(given: &str) -> Result<HostMatch, String> {
        let h = given.trim().trim_end_matches('.').to_ascii_lowercase();
        let (wild, name) = match h.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, h.as_str()),
        };
        let label = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        };
        if name.is_empty()
            || name.len() > 253
            || !name.split('.').all(label)
            || name.parse::<std::net::IpAddr>().is_ok()
        {
            return Err(format!(
                "host `{given}` is not a host name or a wildcard like *.example.com (no IP address, no port)"
            ));
        }
        Ok(if wild { HostMatch::Wildcard(format!(".{name}")) } else { HostMatch::Exact(name.to_string()) })
    }

    /// How this entry matches `host` (lower case, no port), if it does.
    fn rank(&self, host: &str) -> Option<HostRank> {
        match self {
            HostMatch::Exact(name) => (name == host).then_some((true, name.len())),
            HostMatch::Wildcard(suffix) => (host.len() > suffix.len() && host.ends_with(suffix.as_str()))
                .then_some((false, suffix.len() + 1)),
        }
    }
}

/// A request's host as `hosts` compare it: lower case, no port, no trailing dot.
pub fn request_host_name(host: &str) -> String {
    let host = host.trim();
    let host = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or_default(),
        None => match host.rsplit_once(':') {
            Some((h, p)) if !h.contains(':') && p.bytes().all(|b| b.is_ascii_digit()) => h,
            _ => host,
        },
    };
    host.trim_end_matches('.').to_ascii_lowercase()
}

impl Conditions {
    /// Compiles a route's matches. Of several entries with the same name
    /// (header names compare case-insensitively) only the first counts, as
    /// Gateway API says. Fails on a bad method or regular expression.
    pub fn compile(
        method: Option<&str>,
        headers: &[ValueMatch],
        query: &[ValueMatch],
    ) -> Result<Conditions, String> {
        let method = match method {
            None => None,
            Some(m) if !m.is_empty() && m.bytes().all(|b| b.is_ascii_uppercase()) => {
                Some(Method::from_bytes(m.as_bytes()).map_err(|e| format!("method `{m}`: {e}"))?)
            }
            Some(m) => return Err(format!("method `{m}` must be an HTTP method in upper case, e.g. GET")),
        };
        let compile = |list: &[ValueMatch], what: &str, fold: bool| -> Result<Vec<ValueMatcher>, String> {
            let mut out: Vec<ValueMatcher> = Vec::new();
            for m in list {
                let name = if fold { m.name.to_ascii_lowercase() } else { m.name.clone() };
                if name.is_empty() {
                    return Err(format!("a {what} match needs a name"));
                }
                if fold && http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                    return Err(format!("`{}` is not a header name", m.name));
                }
                if out.iter().any(|o| o.name == name) {
                    continue;
                }
                let value = match m.type_ {
                    MatchType::Exact => Matcher::Exact(m.value.clone()),
                    MatchType::RegularExpression => Matcher::Regex(
                        Pattern::new(&m.value).map_err(|e| format!("{what} `{}`: {e}", m.name))?,
                    ),
                };
                out.push(ValueMatcher { name, value });
            }
            Ok(out)
        };
        Ok(Conditions {
            method,
            headers: compile(headers, "header", true)?,
            query: compile(query, "query parameter", false)?,
            hosts: Vec::new(),
        })
    }

    /// These conditions, for requests to one of `hosts` only (see
    /// [`HostMatch::parse`]); fails on an entry that is not a host.
    pub fn with_hosts(mut self, hosts: &[String]) -> Result<Conditions, String> {
        for h in hosts {
            let m = HostMatch::parse(h)?;
            if !self.hosts.contains(&m) {
                self.hosts.push(m);
            }
        }
        Ok(self)
    }

    /// How the rule's hosts match the request's host: `None` when it has
    /// hosts and none matches; `(false, 0)` for a rule without hosts.
    pub fn host_rank(&self, req: &RequestHead) -> Option<HostRank> {
        if self.hosts.is_empty() {
            return Some((false, 0));
        }
        let host = request_host_name(req.host.unwrap_or_default());
        self.hosts.iter().filter_map(|m| m.rank(&host)).max()
    }

    /// Do the request's method, headers and query hold?
    pub fn hold(&self, req: &RequestHead) -> bool {
        if self.method.as_ref().is_some_and(|m| m != req.method) || self.host_rank(req).is_none() {
            return false;
        }
        let header_ok = |m: &ValueMatcher| {
            let mut values = req.headers.get_all(m.name.as_str()).iter().peekable();
            if values.peek().is_none() {
                return false;
            }
            // A repeated header is one value, its values joined by commas (RFC 9110 5.3).
            let joined: Vec<String> =
                values.map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()).collect();
            m.value.is_match(&joined.join(","))
        };
        if !self.headers.iter().all(header_ok) {
            return false;
        }
        self.query.iter().all(|m| query_value(req.query, &m.name).is_some_and(|v| m.value.is_match(&v)))
    }
}

/// The first value of query parameter `name` (percent-decoded; names
/// compare exactly, after decoding).
fn query_value(query: Option<&str>, name: &str) -> Option<String> {
    query?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (percent_decode(k) == name).then(|| percent_decode(v))
    })
}

/// `%XX` escapes decoded (invalid ones kept as they are).
pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
        if b[i] == b'%'
            && i + 2 < b.len()
            && let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2]))
        {
            out.push(h << 4 | l);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// What routing looks at in a request.
#[derive(Debug, Clone, Copy)]
pub struct RequestHead<'a> {
    pub path: &'a str,
    pub method: &'a Method,
    pub headers: &'a HeaderMap,
    pub query: Option<&'a str>,
    /// The request's host (`:authority`, else `Host`), as given.
    pub host: Option<&'a str>,
}

impl<'a> From<&'a http::request::Parts> for RequestHead<'a> {
    fn from(p: &'a http::request::Parts) -> Self {
        let host = p
            .uri
            .authority()
            .map(|a| a.as_str())
            .or_else(|| p.headers.get(http::header::HOST).and_then(|h| h.to_str().ok()));
        RequestHead { path: p.uri.path(), method: &p.method, headers: &p.headers, query: p.uri.query(), host }
    }
}

/// A rule to a backend of any type (a Service, or resolved addresses).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule<B> {
    pub path: String,
    pub path_type: PathType,
    /// What else the request must have (nothing, for Ingress rules).
    pub when: Conditions,
    pub backend: B,
}

impl<B> Rule<B> {
    pub fn new(path: impl Into<String>, path_type: PathType, backend: B) -> Self {
        Rule { path: path.into(), path_type, when: Conditions::default(), backend }
    }

    /// The rule, matching only requests that meet `when` too.
    pub fn when(mut self, when: Conditions) -> Self {
        self.when = when;
        self
    }

    /// Does this rule match the request?
    pub fn matches_request(&self, req: &RequestHead) -> bool {
        self.matches(req.path) && self.when.hold(req)
    }

    /// Does this rule's path match `path`?
    pub fn matches(&self, path: &str) -> bool {
        match self.path_type {
            PathType::Exact => self.path == path,
            PathType::Prefix => {
                let prefix = normalized_prefix(&self.path);
                prefix.is_empty()
                    || path == prefix
                    || (path.starts_with(prefix) && path.as_bytes()[prefix.len()] == b'/')
            }
        }
    }

    /// What decides precedence, greatest first: the path's length (a
    /// prefix's trailing `/` does not count), `Exact`, a method, the number
    /// of header matches, the number of query parameter matches.
    fn rank(&self) -> (usize, bool, bool, usize, usize) {
        let (len, exact) = match self.path_type {
            PathType::Exact => (self.path.len(), true),
            PathType::Prefix => (normalized_prefix(&self.path).len(), false),
        };
        (len, exact, self.when.method.is_some(), self.when.headers.len(), self.when.query.len())
    }

    /// Rules with the same key match the same paths.
    fn key(&self) -> (String, PathType) {
        match self.path_type {
            PathType::Exact => (self.path.clone(), PathType::Exact),
            PathType::Prefix => (normalized_prefix(&self.path).to_string(), PathType::Prefix),
        }
    }
}

/// `/foo/` and `/foo` are the same prefix; `/` is the empty prefix.
fn normalized_prefix(p: &str) -> &str {
    p.trim_end_matches('/')
}

/// The routes of one host, ordered by precedence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table<B> {
    rules: Vec<Rule<B>>,
    default: Option<B>,
}

impl<B> Default for Table<B> {
    fn default() -> Self {
        Table { rules: Vec::new(), default: None }
    }
}

impl<B> Table<B> {
    pub fn new(mut rules: Vec<Rule<B>>, default: Option<B>) -> Self {
        // Longest first, Exact first at equal length; the sort is stable, so
        // among equal rules the first given wins.
        rules.sort_by_key(|r| std::cmp::Reverse(r.rank()));
        Table { rules, default }
    }

    /// The backend of a request path (rules with conditions never match);
    /// `None` answers 404.
    #[cfg(test)]
    pub fn lookup(&self, path: &str) -> Option<&B> {
        self.rules
            .iter()
            .find(|r| r.when == Conditions::default() && r.matches(path))
            .map(|r| &r.backend)
            .or(self.default.as_ref())
    }

    /// The backend of a request; `None` answers 404. Of the rules whose
    /// hosts match, the most specific host match wins (an exact host, then
    /// the longest wildcard, then rules without hosts), then the rules'
    /// precedence (Gateway API: hostnames before paths).
    pub fn lookup_request(&self, req: &RequestHead) -> Option<&B> {
        let mut best: Option<(HostRank, &Rule<B>)> = None;
        for r in &self.rules {
            let Some(rank) = r.when.host_rank(req) else { continue };
            if best.is_some_and(|(b, _)| b >= rank) || !r.matches_request(req) {
                continue;
            }
            best = Some((rank, r));
        }
        best.map(|(_, r)| &r.backend).or(self.default.as_ref())
    }

    /// How many rules (the default backend not counted).
    pub fn len(&self) -> usize {
        self.rules.len()
    }

    pub fn default_backend(&self) -> Option<&B> {
        self.default.as_ref()
    }
}

/// What one Ingress gives one host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Contribution<B> {
    /// Who gives it (`namespace/name` of the Ingress), for messages.
    pub source: String,
    pub rules: Vec<Rule<B>>,
    pub default: Option<B>,
}

/// Two contributions that send the same path to different backends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    /// `Prefix /api`, `Exact /`, or `default backend`.
    pub what: String,
    /// The contribution that is served.
    pub winner: String,
    pub winner_backend: String,
    /// The contribution that is not.
    pub loser: String,
    pub loser_backend: String,
}

impl fmt::Display for Conflict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} is given by {} (to {}) and by {} (to {}); {} was first and is served",
            self.what, self.winner, self.winner_backend, self.loser, self.loser_backend, self.winner
        )
    }
}

/// The merged routes of one host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Merged<B> {
    pub rules: Vec<Rule<B>>,
    pub default: Option<B>,
    pub conflicts: Vec<Conflict>,
}

/// Merges contributions given oldest first: a path given twice to the same
/// backend is one rule; given to different backends, the first contribution
/// keeps it and the conflict is reported.
pub fn merge<B: Clone + PartialEq + fmt::Display>(contributions: &[Contribution<B>]) -> Merged<B> {
    let mut taken: BTreeMap<(String, PathType), (usize, &str)> = BTreeMap::new();
    let mut rules: Vec<Rule<B>> = Vec::new();
    let mut default: Option<(B, &str)> = None;
    let mut conflicts = Vec::new();
    let mut conflict = |what: String, winner: &str, wb: &B, loser: &str, lb: &B| {
        let c = Conflict {
            what,
            winner: winner.to_string(),
            winner_backend: wb.to_string(),
            loser: loser.to_string(),
            loser_backend: lb.to_string(),
        };
        if !conflicts.contains(&c) {
            conflicts.push(c);
        }
    };
    for c in contributions {
        for rule in &c.rules {
            let key = rule.key();
            match taken.get(&key) {
                Some(&(i, _)) if rules[i].backend == rule.backend => {}
                Some(&(i, winner)) => {
                    let what = format!("{:?} {}", rule.path_type, rule.path);
                    conflict(what, winner, &rules[i].backend, &c.source, &rule.backend);
                }
                None => {
                    taken.insert(key, (rules.len(), &c.source));
                    rules.push(rule.clone());
                }
            }
        }
        match (&default, &c.default) {
            (Some((d, winner)), Some(mine)) if d != mine => {
                conflict("the default backend".into(), winner, d, &c.source, mine)
            }
            (None, Some(mine)) => default = Some((mine.clone(), &c.source)),
            _ => {}
        }
    }
    Merged { rules, default: default.map(|(d, _)| d), conflicts }
}

impl fmt::Display for ServiceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.port {
            IntOrString::Int(p) => write!(f, "service {}:{p}", self.name),
            IntOrString::String(p) => write!(f, "service {}:{p}", self.name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use PathType::{Exact, Prefix};

    fn table(rules: &[(&str, PathType, &'static str)], default: Option<&'static str>) -> Table<&'static str> {
        Table::new(rules.iter().map(|(p, t, b)| Rule::new(*p, *t, *b)).collect(), default)
    }

    /// The examples table of the Kubernetes Ingress documentation, plus ours.
    #[test]
    fn precedence_table() {
        type Case<'a> = (&'a [(&'a str, PathType, &'static str)], &'a str, Option<&'a str>);
        let cases: &[Case] = &[
            (&[("/", Prefix, "a")], "/", Some("a")),
            (&[("/", Prefix, "a")], "/anything/at/all", Some("a")),
            (&[("/foo", Exact, "a")], "/foo", Some("a")),
            (&[("/foo", Exact, "a")], "/bar", None),
            (&[("/foo", Exact, "a")], "/foo/", None),
            (&[("/foo/", Exact, "a")], "/foo", None),
            (&[("/foo", Prefix, "a")], "/foo", Some("a")),
            (&[("/foo", Prefix, "a")], "/foo/", Some("a")),
            (&[("/foo/", Prefix, "a")], "/foo", Some("a")),
            (&[("/foo/", Prefix, "a")], "/foo/", Some("a")),
            (&[("/aaa/bb", Prefix, "a")], "/aaa/bbb", None),
            (&[("/aaa/bbb", Prefix, "a")], "/aaa/bbb", Some("a")),
            (&[("/aaa/bbb/", Prefix, "a")], "/aaa/bbb", Some("a")),
            (&[("/aaa/bbb", Prefix, "a")], "/aaa/bbb/", Some("a")),
            (&[("/aaa/bbb", Prefix, "a")], "/aaa/bbb/ccc", Some("a")),
            (&[("/aaa/bbb", Prefix, "a")], "/aaa/bbbxyz", None),
            (&[("/foo", Prefix, "a")], "/foobar", None),
            (&[("/", Prefix, "a"), ("/aaa", Prefix, "b")], "/aaa/ccc", Some("b")),
            (&[("/", Prefix, "a"), ("/aaa", Prefix, "b")], "/ccc", Some("a")),
            (&[("/aaa", Prefix, "a"), ("/aaa", Exact, "b")], "/aaa", Some("b")),
            (&[("/aaa", Prefix, "a"), ("/aaa", Exact, "b")], "/aaa/x", Some("a")),
            (&[("/aaa", Exact, "b"), ("/aaa", Prefix, "a")], "/aaa", Some("b")),
            // A trailing slash does not make a prefix longer than an Exact path.
            (&[("/foo/", Prefix, "a"), ("/foo", Exact, "b")], "/foo", Some("b")),
            // Longest wins whatever the order given.
            (&[("/a/b/c", Prefix, "c"), ("/a", Prefix, "a"), ("/a/b", Prefix, "b")], "/a/b/x", Some("b")),
            (&[("/a", Prefix, "a"), ("/a/b/c", Prefix, "c")], "/a/b/c/d", Some("c")),
            // An Exact rule longer than a prefix wins only on its exact path.
            (&[("/api", Prefix, "a"), ("/api/health", Exact, "h")], "/api/health", Some("h")),
            (&[("/api", Prefix, "a"), ("/api/health", Exact, "h")], "/api/health/x", Some("a")),
        ];
        for (rules, path, want) in cases {
            assert_eq!(table(rules, None).lookup(path).copied(), *want, "{rules:?} on {path}");
        }
    }

    #[test]
    fn default_backend_and_404() {
        let t = table(&[("/api", Prefix, "api")], Some("web"));
        assert_eq!(t.lookup("/api/v1"), Some(&"api"));
        assert_eq!(t.lookup("/apix"), Some(&"web"));
        assert_eq!(t.lookup("/"), Some(&"web"));
        let t = table(&[("/api", Prefix, "api")], None);
        assert_eq!(t.lookup("/other"), None);
        assert_eq!(Table::<&str>::default().lookup("/"), None);
    }

    #[test]
    fn same_rule_first_given_wins() {
        let t = table(&[("/x", Prefix, "first"), ("/x/", Prefix, "second")], None);
        assert_eq!(t.lookup("/x"), Some(&"first"));
    }

    fn head<'a>(parts: &'a http::request::Parts) -> RequestHead<'a> {
        RequestHead::from(parts)
    }

    fn request(method: &str, uri: &str, headers: &[(&str, &str)]) -> http::request::Parts {
        let mut b = http::Request::builder().method(method).uri(uri);
        for (n, v) in headers {
            b = b.header(*n, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    fn vm(name: &str, value: &str, regex: bool) -> ValueMatch {
        let type_ = if regex { MatchType::RegularExpression } else { MatchType::Exact };
        ValueMatch { name: name.into(), value: value.into(), type_ }
    }

    /// A rule with conditions: (path, type, method, headers, query, backend).
    type Spec<'a> = (
        &'a str,
        PathType,
        Option<&'a str>,
        &'a [(&'a str, &'a str)],
        &'a [(&'a str, &'a str)],
        &'static str,
    );

    fn gateway_table(rules: &[Spec]) -> Table<&'static str> {
        let rules = rules
            .iter()
            .map(|(p, t, m, h, q, b)| {
                let h: Vec<_> = h.iter().map(|(n, v)| vm(n, v, false)).collect();
                let q: Vec<_> = q.iter().map(|(n, v)| vm(n, v, false)).collect();
                Rule::new(*p, *t, *b).when(Conditions::compile(*m, &h, &q).unwrap())
            })
            .collect();
        Table::new(rules, None)
    }

    /// Gateway API's HTTPRouteRule precedence: Exact path, then the longest
    /// prefix, then a method match, then the most header matches, then the
    /// most query parameter matches, then the order given.
    #[test]
    fn gateway_api_precedence_table() {
        type Case<'a> = (&'a [Spec<'a>], (&'a str, &'a str, &'a [(&'a str, &'a str)]), Option<&'a str>);
        let none: &[(&str, &str)] = &[];
        let cases: &[Case] = &[
            // Exact before any prefix of the same path.
            (
                &[("/", Prefix, None, none, none, "root"), ("/a", Exact, None, none, none, "exact")],
                ("GET", "/a", none),
                Some("exact"),
            ),
            // Longest prefix before a method, headers or query.
            (
                &[
                    ("/", Prefix, Some("GET"), &[("v", "1")], &[("q", "1")], "root"),
                    ("/a", Prefix, None, none, none, "a"),
                ],
                ("GET", "/a/b?q=1", &[("v", "1")]),
                Some("a"),
            ),
            // Same path: a method before headers.
            (
                &[
                    ("/", Prefix, None, &[("v", "1"), ("w", "2")], none, "headers"),
                    ("/", Prefix, Some("POST"), none, none, "method"),
                ],
                ("POST", "/", &[("v", "1"), ("w", "2")]),
                Some("method"),
            ),
            // Same path, no method: the most headers.
            (
                &[
                    ("/", Prefix, None, &[("v", "1")], none, "one"),
                    ("/", Prefix, None, &[("v", "1"), ("w", "2")], none, "two"),
                ],
                ("GET", "/", &[("v", "1"), ("w", "2")]),
                Some("two"),
            ),
            // ... but only if they hold.
            (
                &[
                    ("/", Prefix, None, &[("v", "1")], none, "one"),
                    ("/", Prefix, None, &[("v", "1"), ("w", "2")], none, "two"),
                ],
                ("GET", "/", &[("v", "1")]),
                Some("one"),
            ),
            // Same headers: the most query parameters.
            (
                &[
                    ("/", Prefix, None, &[("v", "1")], none, "h"),
                    ("/", Prefix, None, &[("v", "1")], &[("q", "1")], "hq"),
                ],
                ("GET", "/?q=1", &[("v", "1")]),
                Some("hq"),
            ),
            // Headers before query parameters.
            (
                &[
                    ("/", Prefix, None, none, &[("a", "1"), ("b", "2")], "query"),
                    ("/", Prefix, None, &[("v", "1")], none, "header"),
                ],
                ("GET", "/?a=1&b=2", &[("v", "1")]),
                Some("header"),
            ),
            // Ties: the first given (a stable sort).
            (
                &[
                    ("/", Prefix, None, &[("v", "1")], none, "first"),
                    ("/", Prefix, None, &[("w", "1")], none, "second"),
                ],
                ("GET", "/", &[("v", "1"), ("w", "1")]),
                Some("first"),
            ),
            (
                &[
                    ("/", Prefix, None, &[("w", "1")], none, "first"),
                    ("/", Prefix, None, &[("v", "1")], none, "second"),
                ],
                ("GET", "/", &[("v", "1"), ("w", "1")]),
                Some("first"),
            ),
            // A method that does not hold: the next rule, or nothing (404).
            (&[("/", Prefix, Some("POST"), none, none, "post")], ("GET", "/", none), None),
            (
                &[("/", Prefix, Some("POST"), none, none, "post"), ("/", Prefix, None, none, none, "any")],
                ("GET", "/", none),
                Some("any"),
            ),
        ];
        for (rules, (method, uri, headers), want) in cases {
            let parts = request(method, uri, headers);
            assert_eq!(
                gateway_table(rules).lookup_request(&head(&parts)).copied(),
                *want,
                "{rules:?} on {method} {uri} {headers:?}"
            );
        }
    }

    #[test]
    fn hosts_match_as_gateway_api_says_and_go_first() {
        let rule = |path: &str, hosts: &[&str], b: &'static str| {
            let hosts: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
            Rule::new(path, Prefix, b).when(Conditions::default().with_hosts(&hosts).unwrap())
        };
        let t = Table::new(
            vec![
                rule("/long/path", &[], "none"),
                rule("/", &["*.example.com"], "wild"),
                rule("/", &["*.a.example.com"], "longer-wild"),
                rule("/", &["Exact.Example.com."], "exact"),
                rule("/only", &["b.example.com", "*.example.net"], "b"),
            ],
            Some("default"),
        );
        let at = |authority: &str, path: &str| {
            let parts = request("GET", &format!("https://{authority}{path}"), &[]);
            t.lookup_request(&head(&parts)).copied()
        };
        assert_eq!(
            at("exact.example.com", "/long/path"),
            Some("exact"),
            "an exact host before a longer path"
        );
        assert_eq!(at("EXACT.example.com:8443", "/"), Some("exact"), "case and port do not count");
        assert_eq!(at("x.a.example.com", "/"), Some("longer-wild"));
        assert_eq!(at("a.example.com", "/"), Some("wild"), "a wildcard needs a label before its suffix");
        assert_eq!(at("deep.x.example.com", "/"), Some("wild"), "one label or more");
        assert_eq!(at("example.com", "/long/path"), Some("none"), "the suffix itself is not matched");
        assert_eq!(at("b.example.com", "/only"), Some("b"));
        assert_eq!(at("c.example.net", "/only/x"), Some("b"));
        assert_eq!(at("c.example.net", "/other"), Some("default"));
        assert_eq!(at("10.0.0.1:80", "/long/path/x"), Some("none"));
        // The Host header when there is no authority (HTTP/1.1 origin form).
        let parts = request("GET", "/", &[("host", "exact.example.com")]);
        assert_eq!(t.lookup_request(&head(&parts)).copied(), Some("exact"));
        for bad in ["10.0.0.1", "a.com:80", "*", "*.", "a.*.com", "a b", "", "-a.com"] {
            assert!(Conditions::default().with_hosts(&[bad.to_string()]).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn header_query_and_method_matches() {
        let h = |list: &[ValueMatch]| Conditions::compile(None, list, &[]).unwrap();
        let q = |list: &[ValueMatch]| Conditions::compile(None, &[], list).unwrap();
        let holds = |c: &Conditions, method: &str, uri: &str, headers: &[(&str, &str)]| {
            c.hold(&head(&request(method, uri, headers)))
        };
        // Header names are case-insensitive, values exact (case-sensitive).
        let c = h(&[vm("X-Env", "canary", false)]);
        assert!(holds(&c, "GET", "/", &[("x-env", "canary")]));
        assert!(!holds(&c, "GET", "/", &[("x-env", "Canary")]));
        assert!(!holds(&c, "GET", "/", &[]), "a missing header does not match");
        // A repeated header is its values joined by commas.
        assert!(holds(&h(&[vm("x-v", "a,b", false)]), "GET", "/", &[("x-v", "a"), ("x-v", "b")]));
        // Of equivalent names only the first counts.
        let c = h(&[vm("x-v", "1", false), vm("X-V", "2", false)]);
        assert_eq!(c.headers.len(), 1);
        assert!(holds(&c, "GET", "/", &[("x-v", "1")]));
        // Regular expressions match the whole value.
        let c = h(&[vm("x-v", "v[0-9]+", true)]);
        assert!(holds(&c, "GET", "/", &[("x-v", "v12")]));
        assert!(!holds(&c, "GET", "/", &[("x-v", "xv12")]), "anchored at the start");
        assert!(!holds(&c, "GET", "/", &[("x-v", "v12x")]), "anchored at the end");
        let c = h(&[vm("x-v", "a|b", true)]);
        assert!(holds(&c, "GET", "/", &[("x-v", "b")]), "alternation inside the anchors");
        assert!(!holds(&c, "GET", "/", &[("x-v", "ab")]));
        // Query parameters: names exact, the first value, percent-decoded.
        let c = q(&[vm("animal", "whale", false)]);
        assert!(holds(&c, "GET", "/?animal=whale", &[]));
        assert!(holds(&c, "GET", "/?x=1&animal=whale&animal=dolphin", &[]));
        assert!(!holds(&c, "GET", "/?animal=dolphin&animal=whale", &[]), "the first value counts");
        assert!(!holds(&c, "GET", "/?ANIMAL=whale", &[]), "names are case-sensitive");
        assert!(!holds(&c, "GET", "/", &[]));
        assert!(holds(&q(&[vm("q", "a b", false)]), "GET", "/?q=a%20b", &[]));
        assert!(holds(&q(&[vm("id", "[0-9]+", true)]), "GET", "/?id=42", &[]));
        assert!(!holds(&q(&[vm("id", "[0-9]+", true)]), "GET", "/?id=42a", &[]));
        // Methods.
        let c = Conditions::compile(Some("PATCH"), &[], &[]).unwrap();
        assert!(holds(&c, "PATCH", "/", &[]));
        assert!(!holds(&c, "GET", "/", &[]));
    }

    #[test]
    fn bad_matches_say_what_is_wrong() {
        let e = Conditions::compile(None, &[vm("x-v", "v[0-9", true)], &[]).unwrap_err();
        assert!(e.starts_with("header `x-v`: `v[0-9` is not a regular expression"), "{e}");
        assert!(!e.contains('\n'), "one line: {e}");
        let e = Conditions::compile(Some("get"), &[], &[]).unwrap_err();
        assert!(e.contains("upper case"), "{e}");
        let e = Conditions::compile(None, &[vm("bad name", "1", false)], &[]).unwrap_err();
        assert!(e.contains("not a header name"), "{e}");
        let e = Conditions::compile(None, &[], &[vm("q", "(", true)]).unwrap_err();
        assert!(e.starts_with("query parameter `q`:"), "{e}");
        let e = Conditions::compile(None, &[vm("x", "a{1000}{1000}", true)], &[]).unwrap_err();
        assert!(e.contains("too large"), "{e}");
    }

    #[test]
    fn ingress_lookup_ignores_rules_with_conditions() {
        let c = Conditions::compile(Some("GET"), &[], &[]).unwrap();
        let t =
            Table::new(vec![Rule::new("/a", Prefix, "cond").when(c), Rule::new("/", Prefix, "plain")], None);
        assert_eq!(t.lookup("/a"), Some(&"plain"));
        let parts = request("GET", "/a", &[]);
        assert_eq!(t.lookup_request(&head(&parts)), Some(&"cond"));
    }

    fn contribution(
        source: &str,
        rules: &[(&str, PathType, &'static str)],
        default: Option<&'static str>,
    ) -> Contribution<&'static str> {
        Contribution {
            source: source.into(),
            rules: rules.iter().map(|(p, t, b)| Rule::new(*p, *t, *b)).collect(),
            default,
        }
    }

    #[test]
    fn merging_adds_paths_and_reports_conflicts() {
        let merged = merge(&[
            contribution("ns/old", &[("/", Prefix, "web"), ("/api", Prefix, "api")], Some("web")),
            contribution(
                "ns/new",
                &[("/api/", Prefix, "api2"), ("/docs", Exact, "docs"), ("/", Prefix, "web")],
                Some("other"),
            ),
        ]);
        let t = Table::new(merged.rules.clone(), merged.default);
        assert_eq!(t.lookup("/docs"), Some(&"docs"), "paths of both Ingresses");
        assert_eq!(t.lookup("/api/x"), Some(&"api"), "the older Ingress keeps a conflicting path");
        assert_eq!(t.lookup("/docs/x"), Some(&"web"));
        assert_eq!(merged.rules.len(), 3, "the same path to the same backend is one rule");
        assert_eq!(merged.conflicts.len(), 2, "{:?}", merged.conflicts);
        assert_eq!(merged.conflicts[0].what, "Prefix /api/");
        assert_eq!(
            (merged.conflicts[0].winner.as_str(), merged.conflicts[0].loser.as_str()),
            ("ns/old", "ns/new")
        );
        assert!(merged.conflicts[0].to_string().contains("ns/old was first"), "{}", merged.conflicts[0]);
        assert_eq!(merged.conflicts[1].what, "the default backend");
        // Exact and Prefix of the same path do not conflict.
        let merged = merge(&[
            contribution("ns/a", &[("/x", Prefix, "a")], None),
            contribution("ns/b", &[("/x", Exact, "b")], None),
        ]);
        assert!(merged.conflicts.is_empty());
        assert_eq!(merged.rules.len(), 2);
    }
}
