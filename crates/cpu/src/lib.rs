//! lily-cpu
