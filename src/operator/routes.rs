//! The path routing of an HTTP tunnel, free of IO: which backend a request
//! path goes to (the Kubernetes Ingress rules), and how the paths several
//! Ingresses give one host are merged.
//!
//! Matching, as the Ingress API defines it:
//! - `Exact`: the request path equals the rule's path (case-sensitive);
//! - `Prefix`: element-wise on `/`: `/foo` (or `/foo/`) matches `/foo`,
//!   `/foo/` and `/foo/bar`, never `/foobar`; `/` matches every path;
//! - the longest matching path wins; at equal length `Exact` beats `Prefix`;
//! - no rule matches: the default backend, or nothing (404).

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::crd::{PathType, ServiceRef};

/// A path rule to a backend of any type (a Service, or resolved addresses).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule<B> {
    pub path: String,
    pub path_type: PathType,
    pub backend: B,
}

impl<B> Rule<B> {
    pub fn new(path: impl Into<String>, path_type: PathType, backend: B) -> Self {
        Rule { path: path.into(), path_type, backend }
    }

    /// Does this rule match `path`?
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

    /// The length that decides precedence (a prefix's trailing `/` does not count).
    fn rank(&self) -> (usize, bool) {
        match self.path_type {
            PathType::Exact => (self.path.len(), true),
            PathType::Prefix => (normalized_prefix(&self.path).len(), false),
        }
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

    /// The backend of a request path; `None` answers 404.
    pub fn lookup(&self, path: &str) -> Option<&B> {
        self.rules.iter().find(|r| r.matches(path)).map(|r| &r.backend).or(self.default.as_ref())
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
