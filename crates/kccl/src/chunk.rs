//! The aggregation chunk size, and the only place it is defined and checked.
//!
//! A chunk is the kccl payload of one UDP datagram, so it follows from the
//! path MTU: the MTU less the IPv4, UDP and kccl headers ([`OVERHEAD`], 68
//! bytes), rounded down to whole int64 elements and capped at what the
//! kernel aggregates in one frame ([`MAX_CHUNK_BYTES`], 65208 = 19
//! sub-blocks).  The group file names the MTU (`mtu`, default 1500); a
//! `chunk_bytes` pin may choose a smaller chunk.  Every member and the
//! aggregator derive the same value from the same group file; the kernel
//! engine gets it before load (`cfg_chunk_bytes`).

use crate::wire::{AGG_MAX_PAYLOAD, HDR_LEN};

/// IPv4 (no options) + UDP + kccl header bytes around a chunk.
pub const OVERHEAD: u32 = 20 + 8 + HDR_LEN as u32;
/// Largest chunk the kernel aggregates (KCCL_AGG_MAX_PAYLOAD).
pub const MAX_CHUNK_BYTES: u32 = AGG_MAX_PAYLOAD as u32;
/// The MTU of a group file that names none (Ethernet's).
pub const DEFAULT_MTU: u32 = 1500;
/// Smallest MTU every IPv4 host must accept (RFC 791).
pub const MIN_MTU: u32 = 576;
/// Largest MTU Linux interfaces (veth, loopback) take.
pub const MAX_MTU: u32 = 65535;
/// The chunk of a [`DEFAULT_MTU`] path: 1432 bytes.
pub const DEFAULT_CHUNK_BYTES: u32 = for_valid_mtu(DEFAULT_MTU);

/// The chunk of an MTU already checked to lie in [`MIN_MTU`]..=[`MAX_MTU`].
const fn for_valid_mtu(mtu: u32) -> u32 {
    let c = (mtu - OVERHEAD) / 8 * 8;
    if c > MAX_CHUNK_BYTES {
        MAX_CHUNK_BYTES
    } else {
        c
    }
}

/// The largest chunk that fits one datagram on a path of `mtu` bytes.
pub fn for_mtu(mtu: i64) -> Result<u32, String> {
    if !(i64::from(MIN_MTU)..=i64::from(MAX_MTU)).contains(&mtu) {
        return Err(format!(
            "`mtu`: {mtu} must lie in [{MIN_MTU}, {MAX_MTU}] (the path MTU of the job's network: 1500 for \
             Ethernet, 9000 for jumbo frames)"
        ));
    }
    Ok(for_valid_mtu(mtu as u32))
}

/// The MTU a chunk of `chunk` bytes needs (one datagram per chunk).
pub const fn mtu_needed(chunk: u32) -> u32 {
    chunk + OVERHEAD
}

/// Checks a chunk size: whole int64 elements, at least one, and at most what
/// the kernel aggregates in one frame.
pub fn check(v: i64) -> Result<u32, String> {
    let max = i64::from(MAX_CHUNK_BYTES);
    if !(8..=max).contains(&v) || v % 8 != 0 {
        return Err(format!(
            "`chunk_bytes`: {v} must be a multiple of 8 in [8, {max}] (the MTU less {OVERHEAD}: 1432 for a 1500-byte \
             MTU, 8928 for 9000, {max} for 65276 or more)"
        ));
    }
    Ok(v as u32)
}

/// The chunk of a group: `pin` if given (checked, and it must fit `mtu`),
/// else the largest one `mtu` allows.
pub fn resolve(mtu: i64, pin: Option<i64>) -> Result<u32, String> {
    let fit = for_mtu(mtu)?;
    match pin {
        None => Ok(fit),
        Some(p) => {
            let c = check(p)?;
            if c > fit {
                return Err(format!(
                    "`chunk_bytes`: {c} needs an MTU of at least {} but the group's `mtu` is {mtu}: raise `mtu` or \
                     drop `chunk_bytes` (it follows from the MTU: {fit})",
                    mtu_needed(c)
                ));
            }
            Ok(c)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_follows_the_mtu() {
        assert_eq!(OVERHEAD, 68);
        assert_eq!(DEFAULT_CHUNK_BYTES, 1432);
        for (mtu, chunk) in [(576, 504), (1500, 1432), (4000, 3928), (9000, 8928), (9001, 8928), (65000, 64928)] {
            assert_eq!(for_mtu(mtu), Ok(chunk), "{mtu}");
            assert!(mtu_needed(chunk) <= mtu as u32);
        }
        assert_eq!(for_mtu(65276), Ok(MAX_CHUNK_BYTES));
        assert_eq!(for_mtu(65535), Ok(MAX_CHUNK_BYTES));
        for bad in [0, 575, 65536, -1] {
            assert!(for_mtu(bad).unwrap_err().contains("`mtu`"), "{bad}");
        }
    }

    #[test]
    fn pins_are_checked_against_the_mtu() {
        assert_eq!(resolve(9000, None), Ok(8928));
        assert_eq!(resolve(9000, Some(1432)), Ok(1432));
        assert_eq!(resolve(1500, Some(1432)), Ok(1432));
        let e = resolve(1500, Some(8928)).unwrap_err();
        assert!(e.contains("8996") && e.contains("1500"), "{e}");
        for bad in [0, 4, 12, 65216, 1433, -8] {
            assert!(check(bad).unwrap_err().contains("`chunk_bytes`"), "{bad}");
        }
        for good in [8, 1432, 3432, 8928, 65208] {
            assert_eq!(check(good), Ok(good as u32));
        }
    }
}
