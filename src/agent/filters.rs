//! The filters of an HTTP route (Gateway API's `HTTPRouteFilter`) as the
//! agent applies them, free of IO: header changes of the request
//! (`RequestHeaderModifier`) and of the response (`ResponseHeaderModifier`),
//! the Host and path the backend gets (`URLRewrite`), and the redirect the
//! agent answers itself (`RequestRedirect`). [`Filters::compile`] is also
//! the operator's check of a Tunnel's filters, so both read them the same way.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{StatusCode, Uri};

use crate::crd::{HeaderModifier, PathModifier, PathModifierType, PathType, RouteFilter, RouteFilterType};

/// Header changes: set (replacing), add (appending), remove, in that order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderEdit {
    set: Vec<(HeaderName, HeaderValue)>,
    add: Vec<(HeaderName, HeaderValue)>,
    remove: Vec<HeaderName>,
}

impl HeaderEdit {
    fn compile(m: &HeaderModifier) -> Result<HeaderEdit, String> {
        let name =
            |n: &str| HeaderName::from_bytes(n.as_bytes()).map_err(|_| format!("`{n}` is not a header name"));
        let pair = |h: &crate::crd::HttpHeader| {
            let value = HeaderValue::from_str(&h.value)
                .map_err(|_| format!("header {}: `{}` is not a header value", h.name, h.value))?;
            Ok::<_, String>((name(&h.name)?, value))
        };
        let edit = HeaderEdit {
            set: m.set.iter().map(pair).collect::<Result<_, _>>()?,
            add: m.add.iter().map(pair).collect::<Result<_, _>>()?,
            remove: m.remove.iter().map(|n| name(n)).collect::<Result<_, _>>()?,
        };
        // Gateway API: one action per header name.
        let mut seen: Vec<&HeaderName> = Vec::new();
        for n in edit.set.iter().map(|(n, _)| n).chain(edit.add.iter().map(|(n, _)| n)).chain(&edit.remove) {
            if seen.contains(&n) {
                return Err(format!(
                    "header {n} is given more than once: one of set, add or remove per header"
                ));
            }
            seen.push(n);
        }
        Ok(edit)
    }

    /// Applies the changes to `headers`.
    pub fn apply(&self, headers: &mut HeaderMap) {
        for (n, v) in &self.set {
            headers.insert(n.clone(), v.clone());
        }
        for (n, v) in &self.add {
            headers.append(n.clone(), v.clone());
        }
        for n in &self.remove {
            headers.remove(n);
        }
    }
}

/// A path change of a redirect or a rewrite.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathChange {
    /// The whole path becomes this.
    Full(String),
    /// The route's prefix `matched` becomes `with`.
    Prefix { matched: String, with: String },
}

impl PathChange {
    fn compile(m: &PathModifier, route_path: &str, path_type: PathType) -> Result<PathChange, String> {
        match m.type_ {
            PathModifierType::ReplaceFullPath => {
                if m.replace_prefix_match.is_some() {
                    return Err("replacePrefixMatch is given with type ReplaceFullPath".into());
                }
                let p = m.replace_full_path.as_ref().ok_or("type ReplaceFullPath needs replaceFullPath")?;
                Ok(PathChange::Full(absolute(p)?))
            }
            PathModifierType::ReplacePrefixMatch => {
                if m.replace_full_path.is_some() {
                    return Err("replaceFullPath is given with type ReplacePrefixMatch".into());
                }
                let p = m
                    .replace_prefix_match
                    .as_ref()
                    .ok_or("type ReplacePrefixMatch needs replacePrefixMatch")?;
                if path_type != PathType::Prefix {
                    return Err("ReplacePrefixMatch needs a route of pathType Prefix".into());
                }
                if !p.is_empty() {
                    absolute(p)?;
                }
                Ok(PathChange::Prefix { matched: route_path.to_string(), with: p.clone() })
            }
        }
    }

    /// The path a request path becomes.
    pub fn apply(&self, path: &str) -> String {
        match self {
            PathChange::Full(p) => p.clone(),
            PathChange::Prefix { matched, with } => replace_prefix(path, matched, with),
        }
    }
}

fn absolute(p: &str) -> Result<String, String> {
    if !p.starts_with('/') {
        return Err(format!("path `{p}` must start with /"));
    }
    if p.contains(['?', '#']) || p.chars().any(|c| c.is_ascii_control() || c == ' ') {
        return Err(format!("path `{p}` must be a path only (no query, fragment, spaces)"));
    }
    Ok(p.to_string())
}

/// Replaces the element-wise prefix `matched` of `path` (which it matches)
/// with `with`, as Gateway API's `ReplacePrefixMatch` table says: trailing
/// slashes of either do not count, an empty result is `/`.
pub fn replace_prefix(path: &str, matched: &str, with: &str) -> String {
    let matched = matched.trim_end_matches('/');
    let rest = path.strip_prefix(matched).unwrap_or(path);
    let out = format!("{}{rest}", with.trim_end_matches('/'));
    match out.as_str() {
        "" => "/".into(),
        o if !o.starts_with('/') => format!("/{o}"),
        _ => out,
    }
}

/// A redirect the agent answers itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Redirect {
    scheme: Option<&'static str>,
    hostname: Option<String>,
    path: Option<PathChange>,
    port: Option<u16>,
    pub status: StatusCode,
}

fn well_known_port(scheme: &str) -> u16 {
    if scheme == "http" { 80 } else { 443 }
}

impl Redirect {
    /// The `Location` of a request: what the redirect does not give is the
    /// request's own (the scheme and port the client used at the edge, from
    /// the edge's `X-Forwarded-Proto` and `X-Forwarded-Port`). A redirect
    /// with a scheme and no port goes to that scheme's well-known port; a
    /// well-known port is left out. The query is kept.
    pub fn location(&self, parts: &http::request::Parts) -> String {
        let forwarded = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok());
        let request_scheme = match forwarded("x-forwarded-proto") {
            Some("http") => "http",
            _ => "https",
        };
        let scheme = self.scheme.unwrap_or(request_scheme);
        let request_host = parts
            .uri
            .host()
            .map(str::to_string)
            .or_else(|| {
                let h = parts.headers.get(header::HOST)?.to_str().ok()?;
                crate::tunnel::proxy::split_host_port(h, 0).map(|(host, _)| host.to_string())
            })
            .unwrap_or_default();
        let host = self.hostname.clone().unwrap_or(request_host);
        let port = match (self.port, self.scheme) {
            (Some(p), _) => p,
            (None, Some(s)) => well_known_port(s),
            (None, None) => forwarded("x-forwarded-port")
                .and_then(|p| p.parse().ok())
                .unwrap_or_else(|| well_known_port(scheme)),
        };
        let port = if port == well_known_port(scheme) { String::new() } else { format!(":{port}") };
        let path = match &self.path {
            Some(change) => change.apply(parts.uri.path()),
            None => parts.uri.path().to_string(),
        };
        let query = parts.uri.query().map(|q| format!("?{q}")).unwrap_or_default();
        format!("{scheme}://{host}{port}{path}{query}")
    }
}

/// What the backend gets instead of the public Host and path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rewrite {
    hostname: Option<String>,
    path: Option<PathChange>,
}

/// The filters of one route, ready to apply.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filters {
    pub request_headers: Option<HeaderEdit>,
    pub response_headers: Option<HeaderEdit>,
    pub redirect: Option<Redirect>,
    pub rewrite: Option<Rewrite>,
}

/// A precise host name (no wildcard, no port), lower case.
fn hostname(h: &str) -> Result<String, String> {
    let ok = !h.is_empty()
        && h.len() <= 253
        && h.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        });
    if ok {
        Ok(h.to_ascii_lowercase())
    } else {
        Err(format!("hostname `{h}` must be a DNS name (no wildcard, no port)"))
    }
}

impl Filters {
    /// Checks and compiles a route's filters (`route_path`/`path_type`: the
    /// route's, for `ReplacePrefixMatch`). Each type at most once, the field
    /// of its type given (and no other), never a redirect with a rewrite.
    pub fn compile(list: &[RouteFilter], route_path: &str, path_type: PathType) -> Result<Filters, String> {
        let mut out = Filters::default();
        let mut seen = Vec::new();
        for f in list {
            if seen.contains(&f.type_) {
                return Err(format!("filter {:?} is given more than once", f.type_));
            }
            seen.push(f.type_);
            let given = [
                (
                    RouteFilterType::RequestHeaderModifier,
                    f.request_header_modifier.is_some(),
                    "requestHeaderModifier",
                ),
                (
                    RouteFilterType::ResponseHeaderModifier,
                    f.response_header_modifier.is_some(),
                    "responseHeaderModifier",
                ),
                (RouteFilterType::RequestRedirect, f.request_redirect.is_some(), "requestRedirect"),
                (RouteFilterType::UrlRewrite, f.url_rewrite.is_some(), "urlRewrite"),
            ];
            for (t, present, field) in given {
                if t == f.type_ && !present {
                    return Err(format!("a filter of type {} needs `{field}`", type_name(t)));
                }
                if t != f.type_ && present {
                    return Err(format!("`{field}` is given in a filter of type {}", type_name(f.type_)));
                }
            }
            let path = |m: &Option<PathModifier>| {
                m.as_ref().map(|m| PathChange::compile(m, route_path, path_type)).transpose()
            };
            match f.type_ {
                RouteFilterType::RequestHeaderModifier => {
                    let m = f.request_header_modifier.as_ref().expect("checked");
                    out.request_headers =
                        Some(HeaderEdit::compile(m).map_err(|e| format!("requestHeaderModifier: {e}"))?);
                }
                RouteFilterType::ResponseHeaderModifier => {
                    let m = f.response_header_modifier.as_ref().expect("checked");
                    out.response_headers =
                        Some(HeaderEdit::compile(m).map_err(|e| format!("responseHeaderModifier: {e}"))?);
                }
                RouteFilterType::RequestRedirect => {
                    let r = f.request_redirect.as_ref().expect("checked");
                    let scheme = match r.scheme.as_deref() {
                        None => None,
                        Some("http") => Some("http"),
                        Some("https") => Some("https"),
                        Some(s) => {
                            return Err(format!("requestRedirect: scheme `{s}` must be http or https"));
                        }
                    };
                    let status = match r.status_code.unwrap_or(302) {
                        c @ (301 | 302 | 303 | 307 | 308) => StatusCode::from_u16(c).expect("valid"),
                        c => {
                            return Err(format!(
                                "requestRedirect: statusCode {c} is not allowed: use 301, 302, 303, 307 or 308"
                            ));
                        }
                    };
                    if r.port == Some(0) {
                        return Err("requestRedirect: port must be 1-65535".into());
                    }
                    out.redirect = Some(Redirect {
                        scheme,
                        hostname: r
                            .hostname
                            .as_deref()
                            .map(hostname)
                            .transpose()
                            .map_err(|e| format!("requestRedirect: {e}"))?,
                        path: path(&r.path).map_err(|e| format!("requestRedirect: {e}"))?,
                        port: r.port,
                        status,
                    });
                }
                RouteFilterType::UrlRewrite => {
                    let r = f.url_rewrite.as_ref().expect("checked");
                    out.rewrite = Some(Rewrite {
                        hostname: r
                            .hostname
                            .as_deref()
                            .map(hostname)
                            .transpose()
                            .map_err(|e| format!("urlRewrite: {e}"))?,
                        path: path(&r.path).map_err(|e| format!("urlRewrite: {e}"))?,
                    });
                }
            }
        }
        if out.redirect.is_some() && out.rewrite.is_some() {
            return Err(
                "RequestRedirect and URLRewrite cannot be combined: a redirect never reaches a backend"
                    .into(),
            );
        }
        Ok(out)
    }

    /// Rewrites the request's URI (host and path, the query kept) as
    /// `URLRewrite` says; the Host header the backend gets follows the URI.
    pub fn rewrite_request(&self, parts: &mut http::request::Parts) -> Result<(), String> {
        let Some(r) = &self.rewrite else { return Ok(()) };
        let path = match &r.path {
            Some(change) => change.apply(parts.uri.path()),
            None => parts.uri.path().to_string(),
        };
        let query = parts.uri.query().map(|q| format!("?{q}")).unwrap_or_default();
        let authority = match &r.hostname {
            Some(h) => h.clone(),
            None => parts.uri.authority().map(|a| a.as_str().to_string()).unwrap_or_default(),
        };
        let scheme = parts.uri.scheme_str().unwrap_or("https").to_string();
        parts.uri = if authority.is_empty() {
            Uri::try_from(format!("{path}{query}"))
        } else {
            Uri::try_from(format!("{scheme}://{authority}{path}{query}"))
        }
        .map_err(|e| format!("the rewritten URI is not valid: {e}"))?;
        if r.hostname.is_some() {
            parts.headers.remove(header::HOST);
        }
        Ok(())
    }

    /// The request header changes (after the head is made for the backend).
    pub fn edit_request(&self, headers: &mut HeaderMap) {
        if let Some(e) = &self.request_headers {
            e.apply(headers);
        }
    }

    /// The response header changes.
    pub fn edit_response(&self, headers: &mut HeaderMap) {
        if let Some(e) = &self.response_headers {
            e.apply(headers);
        }
    }
}

fn type_name(t: RouteFilterType) -> &'static str {
    match t {
        RouteFilterType::RequestHeaderModifier => "RequestHeaderModifier",
        RouteFilterType::ResponseHeaderModifier => "ResponseHeaderModifier",
        RouteFilterType::RequestRedirect => "RequestRedirect",
        RouteFilterType::UrlRewrite => "URLRewrite",
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn filters(v: serde_json::Value, path: &str, path_type: PathType) -> Result<Filters, String> {
        let list: Vec<RouteFilter> = serde_json::from_value(v).unwrap();
        Filters::compile(&list, path, path_type)
    }

    /// The `ReplacePrefixMatch` table of Gateway API's HTTPPathModifier.
    #[test]
    fn replace_prefix_match_table() {
        let table = [
            ("/foo/bar", "/foo", "/xyz", "/xyz/bar"),
            ("/foo/bar", "/foo", "/xyz/", "/xyz/bar"),
            ("/foo/bar", "/foo/", "/xyz", "/xyz/bar"),
            ("/foo/bar", "/foo/", "/xyz/", "/xyz/bar"),
            ("/foo", "/foo", "/xyz", "/xyz"),
            ("/foo/", "/foo", "/xyz", "/xyz/"),
            ("/foo/bar", "/foo", "", "/bar"),
            ("/foo/", "/foo", "", "/"),
            ("/foo", "/foo", "", "/"),
            ("/foo/", "/foo", "/", "/"),
            ("/foo", "/foo", "/", "/"),
            // The root prefix: everything moves under the replacement.
            ("/a/b", "/", "/v2", "/v2/a/b"),
            ("/", "/", "/v2", "/v2/"),
        ];
        for (path, matched, with, want) in table {
            assert_eq!(replace_prefix(path, matched, with), want, "{path} {matched} {with}");
        }
    }

    fn parts(uri: &str, headers: &[(&str, &str)]) -> http::request::Parts {
        let mut b = http::Request::get(uri);
        for (n, v) in headers {
            b = b.header(*n, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn redirect_locations() {
        let https = [("x-forwarded-proto", "https"), ("x-forwarded-port", "443")];
        let http_8080 = [("x-forwarded-proto", "http"), ("x-forwarded-port", "8080")];
        let https_8443 = [("x-forwarded-proto", "https"), ("x-forwarded-port", "8443")];
        // (filter, route path, request, headers, Location, status)
        type Case<'a> = (serde_json::Value, &'a str, &'a str, &'a [(&'a str, &'a str)], &'a str, u16);
        let cases: &[Case] = &[
            (json!({}), "/", "https://a.example/x?q=1", &https, "https://a.example/x?q=1", 302),
            (json!({"scheme": "https"}), "/", "https://a.example/x", &http_8080, "https://a.example/x", 302),
            (json!({"scheme": "http"}), "/", "https://a.example/x", &https, "http://a.example/x", 302),
            // No scheme, no port: the listener's port, left out when well known.
            (json!({}), "/", "https://a.example/x", &http_8080, "http://a.example:8080/x", 302),
            (json!({}), "/", "https://a.example/x", &https_8443, "https://a.example:8443/x", 302),
            (
                json!({"hostname": "b.example"}),
                "/",
                "https://a.example/x",
                &https,
                "https://b.example/x",
                302,
            ),
            (json!({"port": 8443}), "/", "https://a.example/x", &https, "https://a.example:8443/x", 302),
            (json!({"port": 443}), "/", "https://a.example/x", &https, "https://a.example/x", 302),
            (
                json!({"scheme": "http", "port": 80}),
                "/",
                "https://a.example/x",
                &https,
                "http://a.example/x",
                302,
            ),
            (
                json!({"scheme": "https", "port": 80}),
                "/",
                "https://a.example/x",
                &https,
                "https://a.example:80/x",
                302,
            ),
            (json!({"statusCode": 301}), "/", "https://a.example/x", &https, "https://a.example/x", 301),
            (json!({"statusCode": 308}), "/", "https://a.example/x", &https, "https://a.example/x", 308),
            (
                json!({"path": {"type": "ReplaceFullPath", "replaceFullPath": "/new"}}),
                "/",
                "https://a.example/old/x?k=v",
                &https,
                "https://a.example/new?k=v",
                302,
            ),
            (
                json!({"path": {"type": "ReplacePrefixMatch", "replacePrefixMatch": "/replacement-prefix"}}),
                "/original-prefix",
                "https://a.example/original-prefix/lemon",
                &https,
                "https://a.example/replacement-prefix/lemon",
                302,
            ),
        ];
        for (redirect, route, uri, headers, want, status) in cases {
            let f = filters(
                json!([{"type": "RequestRedirect", "requestRedirect": redirect}]),
                route,
                PathType::Prefix,
            )
            .unwrap_or_else(|e| panic!("{redirect}: {e}"));
            let r = f.redirect.unwrap();
            assert_eq!(r.location(&parts(uri, headers)), *want, "{redirect} on {uri}");
            assert_eq!(r.status.as_u16(), *status, "{redirect}");
        }
    }

    #[test]
    fn header_modifiers_set_add_remove() {
        let f = filters(
            json!([{"type": "RequestHeaderModifier", "requestHeaderModifier": {
                "set": [{"name": "X-Set", "value": "new"}],
                "add": [{"name": "x-add", "value": "two"}],
                "remove": ["X-Gone"],
            }}]),
            "/",
            PathType::Prefix,
        )
        .unwrap();
        let mut h = HeaderMap::new();
        for (n, v) in
            [("x-set", "old"), ("x-set", "older"), ("x-add", "one"), ("x-gone", "1"), ("x-kept", "k")]
        {
            h.append(n, HeaderValue::from_static(v));
        }
        f.edit_request(&mut h);
        let all = |n: &str| h.get_all(n).iter().map(|v| v.to_str().unwrap().to_string()).collect::<Vec<_>>();
        assert_eq!(all("x-set"), ["new"], "set replaces every value");
        assert_eq!(all("x-add"), ["one", "two"], "add appends");
        assert!(all("x-gone").is_empty(), "remove drops");
        assert_eq!(all("x-kept"), ["k"]);
        // Responses are edited only by ResponseHeaderModifier.
        let mut r = HeaderMap::new();
        f.edit_response(&mut r);
        assert!(r.is_empty());
    }

    #[test]
    fn url_rewrite_sets_host_and_path_and_keeps_the_query() {
        let f = filters(
            json!([{"type": "URLRewrite", "urlRewrite": {"hostname": "Internal.Example",
                "path": {"type": "ReplacePrefixMatch", "replacePrefixMatch": "/v2"}}}]),
            "/api",
            PathType::Prefix,
        )
        .unwrap();
        let mut p = parts("https://a.example/api/users?id=7", &[("host", "a.example")]);
        f.rewrite_request(&mut p).unwrap();
        assert_eq!(p.uri.to_string(), "https://internal.example/v2/users?id=7");
        assert!(p.headers.get(header::HOST).is_none(), "the Host follows the URI");
        let f = filters(
            json!([{"type": "URLRewrite", "urlRewrite": {"path": {"type": "ReplaceFullPath", "replaceFullPath": "/one"}}}]),
            "/api",
            PathType::Exact,
        )
        .unwrap();
        let mut p = parts("https://a.example/api", &[]);
        f.rewrite_request(&mut p).unwrap();
        assert_eq!(p.uri.to_string(), "https://a.example/one");
    }

    #[test]
    fn bad_filters_say_what_is_wrong() {
        let table = [
            (
                json!([{"type": "RequestRedirect", "requestRedirect": {}}, {"type": "URLRewrite", "urlRewrite": {}}]),
                PathType::Prefix,
                "cannot be combined",
            ),
            (
                json!([{"type": "RequestRedirect", "requestRedirect": {"statusCode": 305}}]),
                PathType::Prefix,
                "statusCode 305 is not allowed",
            ),
            (
                json!([{"type": "RequestRedirect", "requestRedirect": {"scheme": "ftp"}}]),
                PathType::Prefix,
                "scheme `ftp`",
            ),
            (json!([{"type": "RequestRedirect"}]), PathType::Prefix, "needs `requestRedirect`"),
            (
                json!([{"type": "RequestRedirect", "requestRedirect": {}, "urlRewrite": {}}]),
                PathType::Prefix,
                "`urlRewrite` is given in a filter of type RequestRedirect",
            ),
            (
                json!([{"type": "URLRewrite", "urlRewrite": {"path": {"type": "ReplacePrefixMatch", "replacePrefixMatch": "/x"}}}]),
                PathType::Exact,
                "needs a route of pathType Prefix",
            ),
            (
                json!([{"type": "URLRewrite", "urlRewrite": {"path": {"type": "ReplaceFullPath"}}}]),
                PathType::Prefix,
                "needs replaceFullPath",
            ),
            (
                json!([{"type": "URLRewrite", "urlRewrite": {"hostname": "*.example"}}]),
                PathType::Prefix,
                "must be a DNS name",
            ),
            (
                json!([{"type": "RequestHeaderModifier", "requestHeaderModifier": {"set": [{"name": "a", "value": "1"}], "remove": ["A"]}}]),
                PathType::Prefix,
                "header a is given more than once",
            ),
            (
                json!([{"type": "RequestHeaderModifier", "requestHeaderModifier": {"set": [{"name": "bad name", "value": "1"}]}}]),
                PathType::Prefix,
                "is not a header name",
            ),
            (
                json!([{"type": "ResponseHeaderModifier", "responseHeaderModifier": {}}, {"type": "ResponseHeaderModifier", "responseHeaderModifier": {}}]),
                PathType::Prefix,
                "more than once",
            ),
        ];
        for (v, path_type, want) in table {
            let e = filters(v.clone(), "/p", path_type).unwrap_err();
            assert!(e.contains(want), "{v}: {e}");
        }
    }
}
