//! A hint to the CPU to start loading a cache line before it is read.
//!
//! The KV index's overlap walk looks up a request's block hashes in tables
//! far larger than the CPU caches. Asking for every line a batch of lookups
//! will read, before reading any, lets their misses overlap: a plain load
//! that misses holds its instruction in the reorder window until the line
//! arrives, and a window holds only a few lookups' worth. A prefetch
//! retires at once. Rust has no safe prefetch, so this crate, which already
//! audits the project's `unsafe`, offers one.

/// Asks the CPU to bring the cache line holding `value` into its caches
/// (all levels), for reading. A hint only: it has no effect on what any
/// program reads, and does nothing on targets without a prefetch
/// instruction.
#[inline(always)]
pub fn prefetch_read<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: a prefetch reads nothing and cannot fault (it is dropped
        // on an unmapped address), and `value` is a live reference anyway;
        // SSE, which provides the instruction, is part of every x86-64.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(value).cast::<i8>()) }
    }
    #[cfg(target_arch = "aarch64")]
    {
        // SAFETY: `prfm` is a hint: it reads nothing into registers, cannot
        // fault, and touches neither memory nor flags; `value` is live.
        unsafe {
            std::arch::asm!(
                "prfm pldl1keep, [{0}]",
                in(reg) std::ptr::from_ref(value),
                options(nostack, preserves_flags, readonly)
            )
        }
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = value;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefetch_changes_nothing_it_is_given() {
        let v: Vec<u64> = (0..1024).collect();
        for x in &v {
            prefetch_read(x);
        }
        prefetch_read(&v);
        assert_eq!(v.iter().sum::<u64>(), 1023 * 1024 / 2);
    }
}
