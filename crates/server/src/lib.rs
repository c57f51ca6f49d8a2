//! lily-server
