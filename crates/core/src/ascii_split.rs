//! Qwen's pre-tokenizer split, written out by hand for ASCII text.
//!
//! The checkpoint's `tokenizer.json` cuts text into pieces with the regex
//! [`QWEN_SPLIT`] (run by fancy-regex inside the `tokenizers` crate, for its
//! lookahead), maps each piece's bytes to the byte-level alphabet and hands
//! it to the BPE model. Measured on a 255-token chat prompt, that split and
//! mapping were about three quarters of the encode time, most of it
//! allocation (`crates/core/examples/render_bench.rs`). On ASCII text the
//! regex's classes are byte tests (letters `A-Za-z`, numbers `0-9`, White_Space
//! `\t \n \x0b \x0c \r` and space, no marks) and NFC changes nothing, so
//! [`next_piece`] finds the same pieces in one pass; the tokenizer then
//! encodes each piece with the library's BPE model. Text with any other
//! character keeps the library's whole pipeline.
//!
//! How the regex picks a piece at a position: it always matches there (every
//! character starts some alternative), and the first alternative that
//! matches wins, each one with its own backtracking:
//!
//! 1. `(?i:'s|'t|'re|'ve|'m|'ll|'d)`: an apostrophe and a contraction;
//! 2. `[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+`: letters, with at most one leading
//!    character that is not CR, LF, a letter or a number;
//! 3. `\p{N}`: one digit;
//! 4. ` ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*`: an optional space, a run of other
//!    characters, then any CR and LF;
//! 5. `\s*[\r\n]+`: a whitespace run up to and including its last CR or LF;
//! 6. `\s+(?!\S)`: a whitespace run at the end of the text, or all but the
//!    last character of a longer run (that one leads the next piece);
//! 7. `\s+`: a single whitespace character before a non-space.

/// The split pattern of Qwen3.5/3.6's `tokenizer.json`; the fast path is
/// used only when the loaded file's pre-tokenizer has exactly this pattern.
pub(crate) const QWEN_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn is_letter(c: u8) -> bool {
    c.is_ascii_alphabetic()
}

fn is_digit(c: u8) -> bool {
    c.is_ascii_digit()
}

/// Unicode White_Space within ASCII (`u8::is_ascii_whitespace` leaves out
/// the vertical tab, which `\s` includes).
fn is_space(c: u8) -> bool {
    matches!(c, b'\t' | b'\n' | 0x0b | 0x0c | b'\r' | b' ')
}

fn is_newline(c: u8) -> bool {
    c == b'\r' || c == b'\n'
}

/// Neither whitespace, a letter nor a digit: `[^\s\p{L}\p{M}\p{N}]` in ASCII.
fn is_other(c: u8) -> bool {
    !is_letter(c) && !is_digit(c) && !is_space(c)
}

fn run_end(b: &[u8], from: usize, class: fn(u8) -> bool) -> usize {
    b[from..].iter().position(|&c| !class(c)).map_or(b.len(), |k| from + k)
}

/// The end of the piece that starts at `i` (`i < b.len()`, `b` ASCII).
pub(crate) fn next_piece(b: &[u8], i: usize) -> usize {
    let n = b.len();
    let c = b[i];
    // 1. Contractions, either case.
    if c == b'\'' && i + 1 < n {
        let d = b[i + 1].to_ascii_lowercase();
        if matches!(d, b's' | b't' | b'm' | b'd') {
            return i + 2;
        }
        if i + 2 < n && matches!((d, b[i + 2].to_ascii_lowercase()), (b'r', b'e') | (b'v', b'e') | (b'l', b'l')) {
            return i + 3;
        }
    }
    // 2. Letters, with one optional leading character.
    if is_letter(c) {
        return run_end(b, i, is_letter);
    }
    if !is_newline(c) && !is_digit(c) && i + 1 < n && is_letter(b[i + 1]) {
        return run_end(b, i + 1, is_letter);
    }
    // 3. One digit.
    if is_digit(c) {
        return i + 1;
    }
    // 4. Other characters after an optional space, then CRs and LFs.
    let first = if c == b' ' && i + 1 < n && is_other(b[i + 1]) { i + 1 } else { i };
    if is_other(b[first]) {
        let end = run_end(b, first, is_other);
        return run_end(b, end, is_newline);
    }
    // Whitespace from here on.
    let end = run_end(b, i, is_space);
    // 5. Up to the run's last CR or LF.
    if let Some(last) = b[i..end].iter().rposition(|&c| is_newline(c)) {
        return i + last + 1;
    }
    // 6. The whole run at the end of the text, else all but its last space.
    if end == n || end - i == 1 {
        // (7. A single space before a non-space.)
        return end;
    }
    end - 1
}

/// The pieces of ASCII text `b`, in order, as byte ranges that tile it.
pub(crate) fn pieces(b: &[u8]) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let mut at = 0;
    std::iter::from_fn(move || {
        (at < b.len()).then(|| {
            let start = at;
            at = next_piece(b, start);
            start..at
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(s: &str) -> Vec<&str> {
        pieces(s.as_bytes()).map(|r| &s[r]).collect()
    }

    #[test]
    fn every_alternative_cuts_where_the_regex_does() {
        assert_eq!(split("it's"), ["it", "'s"]);
        assert_eq!(split("IT'LL'RE'Ve'd"), ["IT", "'LL", "'RE", "'Ve", "'d"]);
        assert_eq!(split("'sup 'r"), ["'s", "up", " '", "r"]);
        assert_eq!(split("hello world"), ["hello", " world"]);
        assert_eq!(split("a  b"), ["a", " ", " b"]);
        assert_eq!(split("x   \t y"), ["x", "   \t", " y"]);
        assert_eq!(split("1234"), ["1", "2", "3", "4"]);
        assert_eq!(split(" 5"), [" ", "5"]);
        assert_eq!(split("  5"), [" ", " ", "5"]);
        assert_eq!(split("a, b."), ["a", ",", " b", "."]);
        assert_eq!(split(" ...\n\nx"), [" ...\n\n", "x"]);
        assert_eq!(split("x \n \n y"), ["x", " \n \n", " y"]);
        assert_eq!(split("\t\nhi"), ["\t\n", "hi"]);
        assert_eq!(split("end  "), ["end", "  "]);
        assert_eq!(split("\x0bv"), ["\x0bv"]);
        assert_eq!(split("<|im_start|>user"), ["<|", "im", "_start", "|>", "user"]);
        assert_eq!(split("\r\n"), ["\r\n"]);
        assert_eq!(split("'"), ["'"]);
    }
}
