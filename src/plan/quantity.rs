//! Kubernetes resource quantities (`10Gi`, `500M`, `1.5e3`, `250m`) as
//! integers: bytes for storage and memory, millicores for CPU. Fractions
//! round up, as the API server does when it reports a quantity's value.

/// A quantity that does not parse or does not fit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid quantity {quantity:?}: {problem}")]
pub struct QuantityError {
    /// The quantity as written.
    pub quantity: String,
    /// What is wrong with it.
    pub problem: &'static str,
}

/// Parse a quantity into its value in units (bytes for storage), rounding
/// up.
pub fn parse_quantity(quantity: &str) -> Result<u64, QuantityError> {
    scaled(quantity, 0)
}

/// Parse a CPU quantity into millicores, rounding up.
pub fn parse_millis(quantity: &str) -> Result<u64, QuantityError> {
    scaled(quantity, 3)
}

/// Format bytes as a quantity, in the largest binary unit that divides
/// them (`128Mi`, `1Gi`, `1000`).
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["Ei", "Pi", "Ti", "Gi", "Mi", "Ki"];
    for (index, unit) in UNITS.iter().enumerate() {
        let size = 1u64 << (10 * (UNITS.len() - index));
        if bytes != 0 && bytes.is_multiple_of(size) {
            return format!("{}{unit}", bytes / size);
        }
    }
    bytes.to_string()
}

/// Format millicores as a CPU quantity (`100m`, `2`).
pub fn format_millis(millis: u64) -> String {
    if millis != 0 && millis.is_multiple_of(1000) {
        (millis / 1000).to_string()
    } else {
        format!("{millis}m")
    }
}

/// Value × 10^`extra_decimal_exponent`, rounded up.
fn scaled(quantity: &str, extra_decimal_exponent: i32) -> Result<u64, QuantityError> {
    let error = |problem| QuantityError {
        quantity: quantity.to_string(),
        problem,
    };
    let text = quantity.trim();
    let text = text.strip_prefix('+').unwrap_or(text);
    if text.starts_with('-') {
        return Err(error("negative quantities are not sizes"));
    }
    let number_end = text
        .find(|character: char| !(character.is_ascii_digit() || character == '.'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(number_end);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() {
        return Err(error("no number"));
    }
    if fraction.contains('.') {
        return Err(error("more than one decimal point"));
    }
    let (binary_exponent, mut decimal_exponent): (u32, i32) = match suffix {
        "" => (0, 0),
        "Ki" => (10, 0),
        "Mi" => (20, 0),
        "Gi" => (30, 0),
        "Ti" => (40, 0),
        "Pi" => (50, 0),
        "Ei" => (60, 0),
        "n" => (0, -9),
        "u" => (0, -6),
        "m" => (0, -3),
        "k" => (0, 3),
        "M" => (0, 6),
        "G" => (0, 9),
        "T" => (0, 12),
        "P" => (0, 15),
        "E" => (0, 18),
        exponent if exponent.starts_with(['e', 'E']) => {
            let value: i32 = exponent[1..].parse().map_err(|_| error("unknown suffix"))?;
            if !(-30..=30).contains(&value) {
                return Err(error("exponent out of range"));
            }
            (0, value)
        }
        _ => return Err(error("unknown suffix")),
    };
    let digits = format!("{whole}{fraction}");
    if digits.len() > 30 {
        return Err(error("too many digits"));
    }
    let mut numerator: u128 = digits.parse().map_err(|_| error("not a number"))?;
    decimal_exponent += extra_decimal_exponent;
    decimal_exponent -= i32::try_from(fraction.len()).map_err(|_| error("too many digits"))?;
    numerator = numerator
        .checked_mul(1u128 << binary_exponent)
        .ok_or_else(|| error("too large"))?;
    let mut denominator: u128 = 1;
    if decimal_exponent >= 0 {
        numerator = numerator
            .checked_mul(10u128.pow(decimal_exponent.unsigned_abs()))
            .ok_or_else(|| error("too large"))?;
    } else {
        denominator = 10u128.pow(decimal_exponent.unsigned_abs());
    }
    u64::try_from(numerator.div_ceil(denominator)).map_err(|_| error("too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_decimal_and_exponent_forms() {
        assert_eq!(parse_quantity("10Gi"), Ok(10 << 30));
        assert_eq!(parse_quantity("1.5Gi"), Ok(3 << 29));
        assert_eq!(parse_quantity("500M"), Ok(500_000_000));
        assert_eq!(parse_quantity("1e3"), Ok(1000));
        assert_eq!(parse_quantity("12345"), Ok(12345));
        assert_eq!(parse_quantity("0.5"), Ok(1), "fractions round up");
        assert_eq!(parse_millis("100m"), Ok(100));
        assert_eq!(parse_millis("0.25"), Ok(250));
        assert_eq!(parse_millis("2"), Ok(2000));
    }

    #[test]
    fn rejects_what_is_not_a_size() {
        for bad in ["", "Gi", "-1Gi", "10Qi", "1.2.3", "1e99", "99999999999Ei"] {
            assert!(parse_quantity(bad).is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn formats_in_the_largest_dividing_unit() {
        assert_eq!(format_bytes(128 << 20), "128Mi");
        assert_eq!(format_bytes(1 << 30), "1Gi");
        assert_eq!(format_bytes(1000), "1000");
        assert_eq!(format_millis(100), "100m");
        assert_eq!(format_millis(2000), "2");
    }
}
