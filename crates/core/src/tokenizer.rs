//! Placeholder until the tokenizer lands (see issue 2, item 6).
