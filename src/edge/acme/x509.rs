//! The one thing the edge reads from an issued certificate: its validity
//! (`notBefore`, `notAfter`), with a minimal DER walk instead of a full X.509
//! parser.

/// DER tags used on the way to `validity`.
const SEQUENCE: u8 = 0x30;
const INTEGER: u8 = 0x02;
const VERSION: u8 = 0xa0;
const UTC_TIME: u8 = 0x17;
const GENERALIZED_TIME: u8 = 0x18;

/// `(notBefore, notAfter)` of a DER certificate, in Unix seconds.
pub fn validity(der: &[u8]) -> Option<(u64, u64)> {
    let (tag, cert, _) = tlv(der)?;
    if tag != SEQUENCE {
        return None;
    }
    let (tag, mut tbs, _) = tlv(cert)?;
    if tag != SEQUENCE {
        return None;
    }
    // [0] version (optional), serialNumber, signature, issuer, then validity.
    if tbs.first() == Some(&VERSION) {
        tbs = skip(tbs, VERSION)?;
    }
    tbs = skip(tbs, INTEGER)?;
    tbs = skip(tbs, SEQUENCE)?;
    tbs = skip(tbs, SEQUENCE)?;
    let (tag, validity, _) = tlv(tbs)?;
    if tag != SEQUENCE {
        return None;
    }
    let (tag, not_before, rest) = tlv(validity)?;
    let not_before = time(tag, not_before)?;
    let (tag, not_after, _) = tlv(rest)?;
    Some((not_before, time(tag, not_after)?))
}

/// The bytes after one TLV with tag `expect`.
fn skip(input: &[u8], expect: u8) -> Option<&[u8]> {
    let (tag, _, rest) = tlv(input)?;
    (tag == expect).then_some(rest)
}

/// One DER TLV: (tag, contents, the bytes after it).
fn tlv(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, mut rest) = rest.split_first()?;
    let len = if first < 0x80 {
        usize::from(first)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n].iter().fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
        rest = &rest[n..];
        len
    };
    if rest.len() < len {
        return None;
    }
    Some((tag, &rest[..len], &rest[len..]))
}

/// UTCTime `YYMMDDHHMMSSZ` or GeneralizedTime `YYYYMMDDHHMMSSZ` to Unix seconds.
fn time(tag: u8, s: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(s).ok()?.strip_suffix('Z')?;
    let (year, rest) = match tag {
        UTC_TIME if s.len() == 12 => {
            let yy: i64 = s[..2].parse().ok()?;
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, &s[2..])
        }
        GENERALIZED_TIME if s.len() == 14 => (s[..4].parse().ok()?, &s[4..]),
        _ => return None,
    };
    let field = |i: usize| -> Option<i64> { rest.get(i..i + 2)?.parse().ok() };
    let (month, day, hour, minute, second) = (field(0)?, field(2)?, field(4)?, field(6)?, field(8)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    let days = days_from_civil(year, month as u32, day as u32);
    u64::try_from(days * 86_400 + hour * 3600 + minute * 60 + second).ok()
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's `days_from_civil`).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = i64::from((m + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_validity_rcgen_wrote() {
        let mut params = rcgen::CertificateParams::new(vec!["a.example".to_string()]).unwrap();
        params.not_before = rcgen::date_time_ymd(2024, 2, 29);
        params.not_after = rcgen::date_time_ymd(2051, 1, 1); // GeneralizedTime from 2050 on
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        assert_eq!(validity(cert.der()), Some((1_709_164_800, 2_556_144_000)));
    }

    #[test]
    fn rejects_garbage() {
        assert_eq!(validity(b""), None);
        assert_eq!(validity(&[0x30, 0x82, 0xff]), None);
        assert_eq!(validity(&[0x30, 0x03, 0x30, 0x01, 0x02]), None);
        assert_eq!(time(UTC_TIME, b"991332000000Z"), None);
        assert_eq!(time(UTC_TIME, b"700101000000Z"), Some(0));
        assert_eq!(time(GENERALIZED_TIME, b"20000229000000Z"), Some(951_782_400));
    }
}
