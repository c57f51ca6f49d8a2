//! Qwen's pre-tokenizer split, written out by hand.
//!
//! The checkpoint's `tokenizer.json` normalises text to NFC, cuts it into
//! pieces with the regex [`QWEN_SPLIT`] (run by fancy-regex inside the
//! `tokenizers` crate, for its lookahead), maps each piece's bytes to the
//! byte-level alphabet and hands it to the BPE model. That normalisation,
//! split and mapping, with an allocation a piece, were ~95% of encoding a
//! 255-token English chat prompt (`crates/core/examples/render_bench.rs`).
//! [`pieces`] finds the same pieces in one pass over text that is already
//! in NFC (where the normaliser changes nothing), with the regex's character
//! classes taken from `regex-syntax`, the crate whose tables fancy-regex
//! compiles the pattern with; the tokenizer then encodes each piece with the
//! library's BPE model. Text that NFC's quick check does not pass keeps the
//! library's whole pipeline.
//!
//! How the regex picks a piece at a position: it always matches there (every
//! character starts some alternative), and the first alternative that
//! matches wins, each one with its own backtracking:
//!
//! 1. `(?i:'s|'t|'re|'ve|'m|'ll|'d)`: an apostrophe and a contraction, in
//!    either case (`ſ`, U+017F, folds to `s`);
//! 2. `[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+`: letters and marks, with at most one
//!    leading character that is not CR, LF, a letter or a number;
//! 3. `\p{N}`: one number character;
//! 4. ` ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*`: an optional ASCII space, a run of
//!    other characters, then any CR and LF;
//! 5. `\s*[\r\n]+`: a whitespace run up to and including its last CR or LF;
//! 6. `\s+(?!\S)`: a whitespace run at the end of the text, or all but the
//!    last character of a longer run (that one leads the next piece);
//! 7. `\s+`: a single whitespace character before a non-space.

use std::ops::Range;
use std::sync::OnceLock;

/// The split pattern of Qwen3.5/3.6's `tokenizer.json`; the hand split is
/// used only when the loaded file's pre-tokenizer has exactly this pattern.
pub(crate) const QWEN_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The regex's view of a character. The Unicode classes are disjoint:
/// general categories L, M and N, and White_Space (whose members are
/// separators and controls).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Letter,
    Mark,
    Number,
    /// `\s`: White_Space.
    Space,
    /// None of the above: `[^\s\p{L}\p{M}\p{N}]`.
    Other,
}

/// Sorted, non-overlapping code point ranges of the non-ASCII characters
/// that are not `Other`, with their class.
struct Table(Vec<(u32, u32, Class)>);

/// Builds the class table now (regex-syntax parsing its classes, ~0.1 ms),
/// so that the first request with non-ASCII text does not pay for it.
pub(crate) fn build_tables() {
    table();
}

fn table() -> &'static Table {
    static TABLE: OnceLock<Table> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut ranges = Vec::new();
        for (pattern, class) in [(r"\p{L}", Class::Letter), (r"\p{M}", Class::Mark), (r"\p{N}", Class::Number), (r"\s", Class::Space)] {
            for (lo, hi) in unicode_class(pattern) {
                let lo = lo.max(0x80);
                if lo <= hi {
                    ranges.push((lo, hi, class));
                }
            }
        }
        ranges.sort_unstable_by_key(|r| r.0);
        assert!(ranges.windows(2).all(|w| w[0].1 < w[1].0), "the regex's classes overlap");
        Table(ranges)
    })
}

/// The code point ranges `regex-syntax` gives a one-class pattern (Unicode
/// mode, as fancy-regex compiles it).
fn unicode_class(pattern: &str) -> Vec<(u32, u32)> {
    let hir = regex_syntax::parse(pattern).unwrap_or_else(|e| panic!("{pattern}: {e}"));
    match hir.kind() {
        regex_syntax::hir::HirKind::Class(regex_syntax::hir::Class::Unicode(c)) => c.ranges().iter().map(|r| (r.start() as u32, r.end() as u32)).collect(),
        other => panic!("{pattern} is not a Unicode class: {other:?}"),
    }
}

fn class_of(c: char) -> Class {
    match c {
        'a'..='z' | 'A'..='Z' => Class::Letter,
        '0'..='9' => Class::Number,
        '\t' | '\n' | '\x0b' | '\x0c' | '\r' | ' ' => Class::Space,
        '\0'..='\x7f' => Class::Other,
        _ => {
            let cp = c as u32;
            let ranges = &table().0;
            let i = ranges.partition_point(|r| r.1 < cp);
            match ranges.get(i) {
                Some(&(lo, _, class)) if lo <= cp => class,
                _ => Class::Other,
            }
        }
    }
}

fn is_newline(c: char) -> bool {
    c == '\r' || c == '\n'
}

/// `(?i:x)` for the contractions' letters: ASCII case, and `ſ` for `s`
/// (checked against `regex-syntax` by the tests).
fn folds_to(c: char, lower: char) -> bool {
    c.to_ascii_lowercase() == lower || (lower == 's' && c == '\u{17f}')
}

/// Characters of the text with their classes; a piece is a range of them.
struct Chars {
    c: Vec<char>,
    class: Vec<Class>,
}

impl Chars {
    fn run_end(&self, from: usize, pred: impl Fn(char, Class) -> bool) -> usize {
        (from..self.c.len()).find(|&k| !pred(self.c[k], self.class[k])).unwrap_or(self.c.len())
    }

    /// The end (in characters) of the piece that starts at character `i`.
    fn next_piece(&self, i: usize) -> usize {
        let n = self.c.len();
        let (c, class) = (self.c[i], self.class[i]);
        let at = |k: usize| (k < n).then(|| (self.c[k], self.class[k]));
        let letter_or_mark = |_: char, k: Class| matches!(k, Class::Letter | Class::Mark);
        // 1. Contractions.
        if c == '\'' {
            if let Some((d, _)) = at(i + 1) {
                if ['s', 't', 'm', 'd'].iter().any(|&l| folds_to(d, l)) {
                    return i + 2;
                }
                if let Some((e, _)) = at(i + 2) {
                    if [('r', 'e'), ('v', 'e'), ('l', 'l')].iter().any(|&(x, y)| folds_to(d, x) && folds_to(e, y)) {
                        return i + 3;
                    }
                }
            }
        }
        // 2. Letters and marks, with one optional leading character. A
        // leading mark is itself in the run, so either way the piece is
        // the run from `i`.
        if letter_or_mark(c, class) {
            return self.run_end(i, letter_or_mark);
        }
        if !is_newline(c) && class != Class::Number && at(i + 1).is_some_and(|(d, k)| letter_or_mark(d, k)) {
            return self.run_end(i + 1, letter_or_mark);
        }
        // 3. One number character.
        if class == Class::Number {
            return i + 1;
        }
        // 4. Other characters after an optional ASCII space, then CRs and LFs.
        let other = |_: char, k: Class| k == Class::Other;
        let first = if c == ' ' && at(i + 1).is_some_and(|(d, k)| other(d, k)) { i + 1 } else { i };
        if self.class[first] == Class::Other {
            let end = self.run_end(first, other);
            return self.run_end(end, |d, _| is_newline(d));
        }
        // Whitespace from here on.
        let end = self.run_end(i, |_, k| k == Class::Space);
        // 5. Up to the run's last CR or LF.
        if let Some(last) = (i..end).rev().find(|&k| is_newline(self.c[k])) {
            return last + 1;
        }
        // 6. The whole run at the end of the text, else all but its last
        // character; 7. a single whitespace character before a non-space.
        if end == n || end - i == 1 {
            return end;
        }
        end - 1
    }
}

/// The pieces of `text`, in order, as byte ranges that tile it. `text` must
/// be in NFC for these to be the library's pieces (the library normalises
/// first).
pub(crate) fn pieces(text: &str) -> Vec<Range<usize>> {
    let (mut c, mut class) = (Vec::with_capacity(text.len()), Vec::with_capacity(text.len()));
    for ch in text.chars() {
        c.push(ch);
        class.push(class_of(ch));
    }
    let chars = Chars { c, class };
    let mut out = Vec::new();
    let (mut i, mut byte) = (0, 0);
    while i < chars.c.len() {
        let end = chars.next_piece(i);
        let len: usize = chars.c[i..end].iter().map(|c| c.len_utf8()).sum();
        out.push(byte..byte + len);
        byte += len;
        i = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(s: &str) -> Vec<&str> {
        pieces(s).into_iter().map(|r| &s[r]).collect()
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
        // Beyond ASCII: letters with marks, a leading mark, numbers of other
        // scripts, Unicode spaces, the long s.
        assert_eq!(split("caf\u{e9} na\u{ef}ve"), ["caf\u{e9}", " na\u{ef}ve"]);
        assert_eq!(split("\u{301}ab \u{301}x"), ["\u{301}ab", " \u{301}x"]);
        assert_eq!(split("\u{4e2d}\u{6587}\u{ff0c}ok"), ["\u{4e2d}\u{6587}", "\u{ff0c}ok"]);
        assert_eq!(split("\u{663}\u{664}"), ["\u{663}", "\u{664}"]);
        assert_eq!(split("a\u{a0}\u{a0}b"), ["a", "\u{a0}", "\u{a0}b"]);
        assert_eq!(split("x\u{2028}"), ["x", "\u{2028}"]);
        assert_eq!(split("'\u{17f}x"), ["'\u{17f}", "x"]);
    }

    #[test]
    fn the_contractions_fold_as_the_regex_does() {
        for l in ['s', 't', 'r', 'e', 'v', 'm', 'l', 'd'] {
            let expected: Vec<char> = unicode_class(&format!("(?i:{l})")).iter().flat_map(|&(lo, hi)| (lo..=hi).filter_map(char::from_u32)).collect();
            let ours: Vec<char> = (0..=0x10ffffu32).filter_map(char::from_u32).filter(|&c| folds_to(c, l)).collect();
            assert_eq!(ours, expected, "(?i:{l})");
        }
    }

    #[test]
    fn ascii_classes_match_the_regex_tables() {
        for (pattern, class) in [(r"\p{L}", Class::Letter), (r"\p{M}", Class::Mark), (r"\p{N}", Class::Number), (r"\s", Class::Space)] {
            let members = unicode_class(pattern);
            for b in 0u8..128 {
                let c = char::from(b);
                let member = members.iter().any(|&(lo, hi)| (lo..=hi).contains(&(b as u32)));
                assert_eq!(class_of(c) == class, member, "{c:?} in {pattern}");
            }
        }
    }
}
