//! Block hashing for C callers: the same function `kvedge hash`, the
//! daemon and every engine use.

use std::ffi::c_char;

use crate::boundary::*;
use crate::status::*;

/// Sequence hashes of the full blocks of `tokens` (a partial last block is
/// not hashed), identical to `kvedge hash` and to what the daemon computes
/// for token-id selects. `lora_name` and `namespace_` change the seed (NULL
/// or "" for none). Writes `n / block_size` hashes to `out` and their
/// number to `*out_len`; if `out_cap` is smaller, writes nothing but the
/// needed count and returns `KVEDGE_ERR_BUFFER_TOO_SMALL`. No allocation.
///
/// # Safety
/// `tokens` points to `n` `uint32_t` (may be NULL when `n` is 0); the
/// strings are NULL or NUL-terminated; `out` points to `out_cap` writable
/// `uint64_t` (may be NULL when `out_cap` is 0); `out_len` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_hash_blocks(
    tokens: *const u32,
    n: usize,
    block_size: u32,
    lora_name: *const c_char,
    namespace_: *const c_char,
    out: *mut u64,
    out_cap: usize,
    out_len: *mut usize,
) -> kvedge_status {
    guard(|| {
        if out_len.is_null() {
            return Err(Error::null("out_len"));
        }
        if block_size == 0 {
            return Err(Error::invalid("block_size must be positive"));
        }
        // SAFETY: caller contract above.
        let tokens = unsafe { slice(tokens, n, "tokens")? };
        // SAFETY: caller contract above.
        let (lora, ns) = unsafe {
            (
                optional_text(lora_name, "lora_name")?,
                optional_text(namespace_, "namespace_")?,
            )
        };
        let needed = kvedge_schema::hash::full_blocks(tokens.len(), block_size as usize);
        // SAFETY: `out_len` is non-null and writable (caller).
        unsafe { *out_len = needed };
        if needed > out_cap {
            return Err(Error::new(
                KVEDGE_ERR_BUFFER_TOO_SMALL,
                format!("{needed} hashes do not fit in out_cap {out_cap}"),
            ));
        }
        if needed == 0 {
            return Ok(());
        }
        if out.is_null() {
            return Err(Error::null("out"));
        }
        // SAFETY: `out` has `out_cap >= needed` writable elements (caller).
        let out = unsafe { std::slice::from_raw_parts_mut(out, needed) };
        let seed = kvedge_schema::hash::block_seed(lora, ns);
        kvedge_schema::hash::sequence_hashes_into(tokens, block_size as usize, seed, None, out);
        Ok(())
    })
}
