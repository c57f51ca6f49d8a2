//! lily-synth
