//! Command-line tool (`bmqctl`) subcommands.
pub mod admin;
pub mod cluster;
pub mod consume;
pub mod payload;
pub mod produce;
pub mod prometheus;
pub mod ready;
pub mod status;
