//! One module per subcommand.

pub mod agree;
pub mod bench;
pub mod generate;
pub mod quantize;
pub mod serve;
pub mod synth;
