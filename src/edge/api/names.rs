//! Host names: DNS labels, subdomains of the edge's domain, custom domains.

use super::ApiError;
use crate::api::{DEFAULT_HOST, ReservationKind};

/// Whether `s` is a DNS label: 1-63 of `a-z 0-9 -`, not starting or ending with `-`.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// `<name>.<domain>` for a subdomain label (upper case is folded to lower case).
pub fn subdomain(name: &str, domain: &str) -> Result<String, ApiError> {
    let label = name.trim().to_ascii_lowercase();
    if label.contains('.') {
        return Err(ApiError::invalid(
            "invalid_name",
            format!(
                "`{name}` is not a DNS label; give only the first label (it becomes <name>.{domain}), or reserve a full host name as fqdn (culvert admin domain reserve --fqdn HOST)"
            ),
        ));
    }
    if !is_dns_label(&label) {
        return Err(ApiError::invalid(
            "invalid_name",
            format!(
                "`{name}` is not a DNS label: use 1-63 characters of a-z, 0-9 and `-`, not starting or ending with `-`"
            ),
        ));
    }
    let hostname = format!("{label}.{domain}");
    if hostname.len() > 253 {
        return Err(ApiError::invalid(
            "invalid_name",
            format!("{hostname} is longer than 253 characters; use a shorter name"),
        ));
    }
    Ok(hostname)
}

/// Validates a full host name: lower-cased, trailing dot dropped, at most 253
/// characters, two or more DNS labels, not an IP address.
pub fn normalize_hostname(host: &str) -> Result<String, ApiError> {
    let h = host.trim().to_ascii_lowercase();
    let h = h.strip_suffix('.').unwrap_or(&h).to_string();
    let bad = |why: &str| {
        ApiError::invalid("invalid_domain", format!("`{host}` is not a valid domain name: {why}"))
    };
    if h.parse::<std::net::IpAddr>().is_ok() {
        return Err(bad("IP addresses cannot be reserved, only names"));
    }
    if h.len() > 253 {
        return Err(bad("it is longer than 253 characters"));
    }
    let labels: Vec<&str> = h.split('.').collect();
    if labels.len() < 2 {
        return Err(bad("it needs at least two labels, like app.example.com"));
    }
    if let Some(label) = labels.iter().find(|l| !is_dns_label(l)) {
        return Err(bad(&format!(
            "label `{label}` is not a DNS label (1-63 characters of a-z, 0-9 and `-`, not starting or ending with `-`)"
        )));
    }
    if labels.last().is_some_and(|tld| tld.bytes().all(|b| b.is_ascii_digit())) {
        return Err(bad("the last label cannot be all digits"));
    }
    Ok(h)
}

/// Classifies an `fqdn`: a name one label under the edge's domain is a
/// subdomain (normalised); deeper names under it are refused (the wildcard
/// certificate covers one level); the edge's own name is refused; anything
/// else is a custom domain. `*` is the edge's default host (a custom domain
/// reservation, see [`DEFAULT_HOST`]).
pub fn custom_or_subdomain(fqdn: &str, domain: &str) -> Result<(ReservationKind, String), ApiError> {
    if fqdn.trim() == DEFAULT_HOST {
        return Ok((ReservationKind::Custom, DEFAULT_HOST.to_string()));
    }
    let host = normalize_hostname(fqdn)?;
    if host == domain {
        return Err(ApiError::invalid(
            "reserved_name",
            format!(
                "{domain} is the edge's own name and cannot be reserved; reserve <name>.{domain} instead"
            ),
        ));
    }
    match host.strip_suffix(domain).and_then(|p| p.strip_suffix('.')) {
        Some(label) if !label.contains('.') => Ok((ReservationKind::Subdomain, host)),
        Some(_) => Err(ApiError::invalid(
            "invalid_domain",
            format!(
                "{host} is more than one level under the edge's domain {domain}; the edge serves <name>.{domain} only: reserve a single label, or a domain outside {domain}"
            ),
        )),
        None => Ok((ReservationKind::Custom, host)),
    }
}

/// The host name a path segment or `domain` field means: a bare label is
/// `<label>.<domain>`, anything with a dot is a full host name, `*` the
/// default host.
pub(super) fn lookup_hostname(host: &str, domain: &str) -> Result<String, ApiError> {
    if host.trim() == DEFAULT_HOST {
        Ok(DEFAULT_HOST.to_string())
    } else if host.contains('.') {
        normalize_hostname(host)
    } else {
        subdomain(host, domain)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::percent_decode;

    #[test]
    fn names() {
        assert!(is_dns_label("a") && is_dns_label("a-1") && is_dns_label(&"a".repeat(63)));
        assert!(!is_dns_label("") && !is_dns_label("-a") && !is_dns_label("a-") && !is_dns_label("A"));
        assert_eq!(
            custom_or_subdomain("x.edge.example.com", "edge.example.com").unwrap(),
            (ReservationKind::Subdomain, "x.edge.example.com".to_string())
        );
        assert_eq!(
            custom_or_subdomain("shop.example.com", "edge.example.com").unwrap(),
            (ReservationKind::Custom, "shop.example.com".to_string())
        );
        // A suffix match on a label boundary only.
        assert_eq!(
            custom_or_subdomain("myedge.example.com", "edge.example.com").unwrap().0,
            ReservationKind::Custom
        );
        assert_eq!(
            custom_or_subdomain(" * ", "edge.example.com").unwrap(),
            (ReservationKind::Custom, "*".to_string())
        );
        assert_eq!(lookup_hostname("*", "edge.example.com").unwrap(), "*");
        assert!(custom_or_subdomain("*.example.com", "edge.example.com").is_err());
        assert_eq!(percent_decode("a%3Db%2Cc").as_deref(), Some("a=b,c"));
        assert_eq!(percent_decode("%zz"), None);
    }
}
