//! Sizes for cache and memory bounds, shared by the `sealed` CLI and the CSI node plugin so
//! both accept the same spellings, with the meaning Kubernetes quantities have: `Ki`, `Mi`,
//! `Gi`, `Ti`, `Pi`, `Ei` are powers of 1024 and `k`, `M`, `G`, `T`, `P`, `E` powers of 1000
//! (`50Gi`, `50G`, `1.5Ti`, `4096`). A trailing `B` is allowed (`512MiB`, `10GB`).

/// The multiplier of a suffix, or `None` when it is not one.
fn multiplier(suffix: &str) -> Option<u128> {
    Some(match suffix {
        "" => 1,
        "Ki" | "KiB" => 1 << 10,
        "Mi" | "MiB" => 1 << 20,
        "Gi" | "GiB" => 1 << 30,
        "Ti" | "TiB" => 1 << 40,
        "Pi" | "PiB" => 1 << 50,
        "Ei" | "EiB" => 1 << 60,
        "k" | "kB" | "KB" => 1_000,
        "M" | "MB" => 1_000_000,
        "G" | "GB" => 1_000_000_000,
        "T" | "TB" => 1_000_000_000_000,
        "P" | "PB" => 1_000_000_000_000_000,
        "E" | "EB" => 1_000_000_000_000_000_000,
        _ => return None,
    })
}

/// Parses a size: a decimal number of bytes with an optional suffix (see the module). The
/// arithmetic is exact (no floating point): a fraction of a byte is rounded down.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, suffix) = t.split_at(split);
    let Some(unit) = multiplier(suffix) else {
        let hint = match suffix {
            "m" => " (m is milli in Kubernetes quantities: write Mi or M)",
            "K" => " (write Ki for 1024 or k for 1000)",
            _ => "",
        };
        return Err(format!(
            "'{text}' is not a size{hint}: write 50Gi (powers of 1024), 50G (powers of 1000) \
             or a number of bytes"
        ));
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty()
        || !whole
            .bytes()
            .chain(fraction.bytes())
            .all(|b| b.is_ascii_digit())
    {
        return Err(format!(
            "'{text}' is not a size: write 50Gi, 50G, 1.5Ti or a number of bytes"
        ));
    }
    let too_large = || format!("'{text}' is too large");
    let whole: u128 = whole.parse().map_err(|_| too_large())?;
    let mut bytes = whole.checked_mul(unit).ok_or_else(too_large)?;
    // The fraction's digits beyond what the unit can resolve add nothing.
    let fraction = &fraction[..fraction.len().min(19)];
    if !fraction.is_empty() {
        let digits: u128 = fraction.parse().map_err(|_| too_large())?;
        let scale = 10u128.pow(fraction.len() as u32);
        let part = digits.checked_mul(unit).ok_or_else(too_large)? / scale;
        bytes = bytes.checked_add(part).ok_or_else(too_large)?;
    }
    u64::try_from(bytes).map_err(|_| too_large())
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_have_the_kubernetes_meaning() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("10Gi"), Ok(10 << 30));
        assert_eq!(parse_size("10G"), Ok(10_000_000_000));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("512MB"), Ok(512_000_000));
        assert_eq!(parse_size("1.5Ti"), Ok(3 << 39));
        assert_eq!(parse_size("1.5k"), Ok(1500));
        assert_eq!(parse_size(" 256Mi "), Ok(256 << 20));
        assert_eq!(parse_size("0.5"), Ok(0), "a fraction of a byte rounds down");
        assert_eq!(parse_size("15Ei"), Ok(15 << 60));
    }

    #[test]
    fn bad_sizes_say_why() {
        for bad in [
            "lots", "-1G", "", ".5G", "1..5G", "1e3", "10 G", "1.5.5", "Gi",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(parse_size("512m").unwrap_err().contains("milli"));
        assert!(parse_size("10K").unwrap_err().contains("Ki for 1024"));
        assert!(parse_size("16Ei").unwrap_err().contains("too large"));
        assert!(
            parse_size("99999999999T")
                .unwrap_err()
                .contains("too large")
        );
        assert!(
            parse_size("340282366920938463463374607431768211456")
                .unwrap_err()
                .contains("too large")
        );
    }
}
