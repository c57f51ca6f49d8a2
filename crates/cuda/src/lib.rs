//! lily-cuda
