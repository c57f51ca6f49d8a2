//! The fixed parts of the benchmark contract (docs/design.md §7.1) that every bench
//! entry point shares: the synthetic prompts and the digest of generated ids.

/// The synthetic prompt of the contract: token i is
/// `((i * 2654435761) mod 2^32) mod vocab`.
pub fn prompt_tokens(len: usize, vocab: usize) -> Vec<u32> {
    (0..len).map(|i| (((i as u64).wrapping_mul(2_654_435_761) % (1u64 << 32)) % vocab as u64) as u32).collect()
}

/// Prompt of sequence `i` of a batch run (`lily bench --batch`): the
/// contract's token formula from position 131 i on, so the sequences differ
/// (and route to different experts, as real users do).
pub fn batch_prompt_tokens(i: usize, len: usize, vocab: usize) -> Vec<u32> {
    prompt_tokens(len + 131 * i, vocab).split_off(131 * i)
}

/// FNV-1a (64-bit) over the little-endian bytes of the ids, as 16 hex digits.
pub fn fnv1a_digest(ids: &[u32]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for id in ids {
        for b in id.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_follows_the_formula() {
        let p = prompt_tokens(4, 248_320);
        assert_eq!(p[0], 0);
        assert_eq!(p[1], (2_654_435_761u64 % 248_320) as u32);
        assert_eq!(p[2], ((2 * 2_654_435_761u64) % (1 << 32) % 248_320) as u32);
    }

    #[test]
    fn fnv1a_of_nothing_is_the_offset_basis_and_order_matters() {
        assert_eq!(fnv1a_digest(&[]), "cbf29ce484222325");
        // One id 0x61 is the bytes 61 00 00 00.
        assert_ne!(fnv1a_digest(&[0x61]), fnv1a_digest(&[0x61, 0]));
        assert_ne!(fnv1a_digest(&[1, 2]), fnv1a_digest(&[2, 1]));
    }
}
