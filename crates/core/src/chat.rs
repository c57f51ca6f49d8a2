//! Placeholder until the chat template lands (see issue 2, item 7).
