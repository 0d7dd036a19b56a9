//! The page rendered on the server, so it reads without JavaScript;
//! `page.js` renders the same markup from every event.

use std::fmt::Write;

use super::model::{EdgeStatus, History, Status, TunnelStatus, Usage};
use super::traffic;

const PAGE: &str = include_str!("page.html");
const LOGIN: &str = include_str!("login.html");

/// HTML-escapes text and attribute values.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Fills `{{name}}` placeholders in one pass (a value is never scanned again).
fn fill(template: &str, values: &[(&str, String)]) -> String {
    let mut out = String::with_capacity(template.len() * 2);
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        match after.find("}}") {
            Some(end) => {
                let name = &after[..end];
                match values.iter().find(|(n, _)| *n == name) {
                    Some((_, v)) => out.push_str(v),
                    None => panic!("template placeholder {{{{{name}}}}} has no value"),
                }
                rest = &after[end + 2..];
            }
            None => {
                out.push_str(&rest[start..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// `1.5 KiB`.
pub fn bytes(n: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let (mut v, mut i) = (n, 0);
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 { format!("{} B", v.round()) } else { format!("{v:.1} {}", UNITS[i]) }
}

/// `2h 5m`.
pub fn duration(s: u64) -> String {
    let (d, h, m, s) = (s / 86400, s / 3600 % 24, s / 60 % 60, s % 60);
    match () {
        _ if d > 0 => format!("{d}d {h}h"),
        _ if h > 0 => format!("{h}h {m}m"),
        _ if m > 0 => format!("{m}m {s}s"),
        _ => format!("{s}s"),
    }
}

/// `1 stream`, `2 streams`.
fn plural(n: u64, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}

fn rate(n: f64) -> String {
    if n == 0.0 {
        "0".into()
    } else if n < 10.0 {
        format!("{n:.1}")
    } else {
        format!("{}", n.round())
    }
}

fn usage(u: &Usage, fmt: impl Fn(u64) -> String) -> String {
    match (u.used, u.budget) {
        (Some(used), Some(budget)) if budget > 0 => format!(
            "{} of {} <meter min=\"0\" max=\"{budget}\" value=\"{used}\" high=\"{}\">{}%</meter>",
            fmt(used),
            fmt(budget),
            budget / 10 * 8,
            used * 100 / budget
        ),
        (Some(used), _) => format!("{} (no limit)", fmt(used)),
        (None, _) => "unknown".into(),
    }
}

fn edge_items(e: &EdgeStatus) -> String {
    let mut out = String::new();
    let mut item = |id: &str, term: &str, value: String| {
        let _ = write!(out, "<div><dt>{term}</dt><dd id=\"edge-{id}\">{value}</dd></div>");
    };
    item("version", "Version", format!("{} (tunnel protocol {})", esc(&e.version), e.protocol_version));
    let draining = if e.draining { " <strong>draining</strong>" } else { "" };
    item(
        "uptime",
        "Uptime",
        format!("{} since {}{draining}", duration(e.uptime_seconds), esc(&e.started_at)),
    );
    let mut listeners: Vec<String> =
        e.listeners.iter().map(|l| format!("{} {}", esc(&l.name), esc(&l.address))).collect();
    listeners.push(format!("{} TCP port{}", e.tcp_listeners, if e.tcp_listeners == 1 { "" } else { "s" }));
    item("listeners", "Listeners", listeners.join(", "));
    item("fds", "Open files", usage(&e.fds, |n| n.to_string()));
    item("memory", "Memory (RSS)", usage(&e.memory, |n| bytes(n as f64)));
    let store = match (&e.store.ok, &e.store.error) {
        (true, _) => format!("{}: ok ({:.1} ms)", esc(&e.store.engine), e.store.latency_ms),
        (false, err) => {
            format!(
                "{}: <strong>failing</strong>: {}",
                esc(&e.store.engine),
                esc(err.as_deref().unwrap_or(""))
            )
        }
    };
    item("store", "Store", store);
    item(
        "agents",
        "Agents",
        format!("{} connected, {} open", e.agents_connected, plural(e.streams_open, "stream")),
    );
    let acme = match &e.acme {
        None => "off".to_string(),
        Some(a) => {
            let mut s = format!("{} in flight", a.in_flight.len());
            if !a.in_flight.is_empty() {
                let _ = write!(s, ": {}", esc(&a.in_flight.join(", ")));
            }
            for err in &a.errors {
                let _ = write!(s, "<br>{}: {}", esc(&err.hostname), esc(&err.error));
            }
            s
        }
    };
    item("acme", "ACME", acme);
    item("events", "Live views", format!("{} of {} open", e.events.subscribers, e.events.max_subscribers));
    out
}

/// A small chart of requests (line) and bytes (area) per interval.
fn chart(h: &History) -> String {
    let (w, ht) = (180.0, 32.0);
    let step = w / (h.points.max(2) - 1) as f64;
    let line = |values: &[u64]| -> String {
        let max = values.iter().copied().max().unwrap_or(0).max(1) as f64;
        let x0 = w - step * (values.len().saturating_sub(1)) as f64;
        values
            .iter()
            .enumerate()
            .map(|(i, v)| {
                format!("{:.1},{:.1}", x0 + step * i as f64, ht - 1.0 - (ht - 2.0) * *v as f64 / max)
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    let bytes_total: Vec<u64> = h.bytes_in.iter().zip(&h.bytes_out).map(|(a, b)| a + b).collect();
    let max_req = h.requests.iter().copied().max().unwrap_or(0);
    let label = format!(
        "Traffic over the last {}: up to {} requests and {} per {} s",
        duration(h.interval_seconds * h.points as u64),
        max_req,
        bytes(bytes_total.iter().copied().max().unwrap_or(0) as f64),
        h.interval_seconds
    );
    format!(
        "<svg class=\"chart\" viewBox=\"0 0 {w} {ht}\" width=\"{w}\" height=\"{ht}\" role=\"img\" aria-label=\"{label}\">\
         <title>{label}</title><line class=\"axis\" x1=\"0\" y1=\"{ht}\" x2=\"{w}\" y2=\"{ht}\"/>\
         <polyline class=\"bytes\" points=\"{}\"/><polyline class=\"requests\" points=\"{}\"/></svg>",
        line(&bytes_total),
        line(&h.requests),
    )
}

fn row(t: &TunnelStatus) -> String {
    let mut labels: Vec<String> = t.labels.iter().map(|(k, v)| format!("{}={}", esc(k), esc(v))).collect();
    labels.truncate(8);
    let kind = match t.kind {
        crate::api::ReservationKind::Subdomain => "subdomain",
        crate::api::ReservationKind::Custom if t.name == crate::api::DEFAULT_HOST => "default host",
        crate::api::ReservationKind::Custom => "custom domain",
        crate::api::ReservationKind::Tcp if t.name.starts_with("udp:") => "UDP port",
        crate::api::ReservationKind::Tcp => "TCP port",
    };
    let mut sub = format!("{kind} · {}", esc(&t.owner));
    if !labels.is_empty() {
        let _ = write!(sub, " · {}", labels.join(", "));
    }
    let cert = match &t.certificate {
        None => "–".to_string(),
        Some(c) => {
            let status = serde_json::to_value(c.status).ok().and_then(|v| v.as_str().map(String::from));
            let mut s = esc(&status.unwrap_or_default());
            if let Some(until) = &c.not_after {
                let _ = write!(s, ", until {}", esc(until));
            }
            if let Some(err) = &c.last_error {
                let _ = write!(s, "<br><span class=\"err\">{}</span>", esc(err));
            }
            s
        }
    };
    let mut agents = format!(
        "<td class=\"agents\" data-count=\"{0}\"><span class=\"count\">{0}</span>",
        t.agents_connected
    );
    if !t.agents.is_empty() {
        agents.push_str("<ul>");
        for a in &t.agents {
            let _ = write!(
                agents,
                "<li>{} · {} · since {} · v{} · {} · {}</li>",
                esc(&a.agent_id),
                esc(&a.address),
                esc(&a.since),
                a.protocol_version,
                esc(&short_cipher(&a.cipher)),
                plural(a.streams_open, "stream")
            );
        }
        agents.push_str("</ul>");
    }
    agents.push_str("</td>");
    let tot = &t.totals;
    format!(
        "<tr data-name=\"{name}\" data-id=\"{id}\">\
         <th scope=\"row\" class=\"name\"><a href=\"{url}\">{name}</a><div class=\"sub\">{sub}</div></th>\
         <td class=\"cert\">{cert}</td>{agents}\
         <td class=\"streams num\">{streams}</td>\
         <td class=\"requests num\">{requests}</td>\
         <td class=\"rps num\">{rps}</td>\
         <td class=\"in num\"><span class=\"total\">{bin}</span><br><span class=\"rate\">{bins}/s</span></td>\
         <td class=\"out num\"><span class=\"total\">{bout}</span><br><span class=\"rate\">{bouts}/s</span></td>\
         <td class=\"errors num\"><span class=\"e4\">{e4}</span> / <span class=\"e5\">{e5}</span> / <span class=\"offline\">{off}</span></td>\
         <td class=\"traffic\">{chart}</td></tr>",
        name = esc(&t.name),
        id = esc(&t.id),
        url = esc(&t.url),
        streams = t.streams_open,
        requests = tot.requests,
        rps = rate(t.rates.requests),
        bin = bytes(tot.bytes_in as f64),
        bins = bytes(t.rates.bytes_in),
        bout = bytes(tot.bytes_out as f64),
        bouts = bytes(t.rates.bytes_out),
        e4 = tot.errors4xx,
        e5 = tot.errors5xx,
        off = tot.offline,
        chart = chart(&t.history),
    )
}

/// `TLS13_CHACHA20_POLY1305_SHA256` as `CHACHA20-POLY1305`.
fn short_cipher(suite: &str) -> String {
    let s = suite.strip_prefix("TLS13_").unwrap_or(suite);
    let s = s.strip_suffix("_SHA256").or_else(|| s.strip_suffix("_SHA384")).unwrap_or(s);
    s.replace('_', "-")
}
fn shown(s: &Status) -> String {
    if s.tunnels_total == 0 {
        "No reservations yet: culvert admin domain reserve NAME, or port reserve.".into()
    } else if s.tunnels_shown < s.tunnels_total {
        format!(
            "{} of {} reservations shown: those with agents, then the busiest (culvert admin domain list shows all).",
            s.tunnels_shown, s.tunnels_total
        )
    } else {
        format!("{} reservation{}.", s.tunnels_total, if s.tunnels_total == 1 { "" } else { "s" })
    }
}

/// The status page.
pub fn render(s: &Status, base: &str, logout: bool) -> String {
    let rows: String = s.tunnels.iter().map(row).collect();
    let logout = if logout {
        format!(
            "<form method=\"post\" action=\"{base}/logout\"><button type=\"submit\">Log out</button></form>"
        )
    } else {
        String::new()
    };
    fill(
        PAGE,
        &[
            ("domain", esc(&s.edge.domain)),
            ("base", esc(base)),
            ("generated", esc(&s.generated_at)),
            ("logout", logout),
            ("edge", edge_items(&s.edge)),
            ("shown", esc(&shown(s))),
            ("interval", traffic::INTERVAL.as_secs().to_string()),
            ("window", duration(traffic::INTERVAL.as_secs() * traffic::POINTS as u64)),
            ("rows", rows),
            ("version", s.status_version.to_string()),
        ],
    )
}

/// The login form, with why the last try was refused.
pub fn login(base: &str, message: Option<&str>) -> String {
    let message =
        message.map(|m| format!("<p class=\"refused\" role=\"alert\">{}</p>", esc(m))).unwrap_or_default();
    fill(LOGIN, &[("base", esc(base)), ("message", message)])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_in_one_pass_and_escapes() {
        let out = fill("a {{x}} b {{y}} c", &[("x", "{{y}}".into()), ("y", "2".into())]);
        assert_eq!(out, "a {{y}} b 2 c");
        assert_eq!(esc("<a href=\"x\">&'"), "&lt;a href=&quot;x&quot;&gt;&amp;&#39;");
        assert!(login("/b", Some("<no>")).contains("&lt;no&gt;"));
    }

    #[test]
    fn formats() {
        assert_eq!(bytes(0.0), "0 B");
        assert_eq!(bytes(1536.0), "1.5 KiB");
        assert_eq!(bytes(3.0 * 1024.0 * 1024.0), "3.0 MiB");
        assert_eq!(duration(59), "59s");
        assert_eq!(duration(3725), "1h 2m");
        assert_eq!(duration(90000), "1d 1h");
    }
}
