//! lily-engine
