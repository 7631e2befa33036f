//! Small pieces of text more than one verb's rendering shows alike.

/// A claim's access modes, and when it is handed back with others, both:
/// `then` words the change from the first (joined) to the last.
pub fn access_modes(
    modes: &[String],
    final_modes: &[String],
    then: impl Fn(&str, &str) -> String,
) -> String {
    if final_modes.is_empty() {
        modes.join(",")
    } else {
        then(&modes.join(","), &final_modes.join(","))
    }
}

/// The first twelve characters of an id or tree hash (all of a shorter one).
pub fn short_id(id: &str) -> &str {
    &id[..id.len().min(12)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_modes_show_the_change_only_when_the_claim_gets_other_ones() {
        let modes = ["ReadWriteOnce".to_string()];
        let then = |first: &str, last: &str| format!("{first} -> {last}");
        assert_eq!(access_modes(&modes, &[], then), "ReadWriteOnce");
        assert_eq!(
            access_modes(&modes, &["ReadOnlyMany".to_string()], then),
            "ReadWriteOnce -> ReadOnlyMany"
        );
        assert_eq!(short_id("0123456789abcdef"), "0123456789ab");
        assert_eq!(short_id("abc"), "abc");
    }
}
