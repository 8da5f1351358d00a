//! Command-line tool (`bmqctl`) subcommands.
pub mod admin;
pub mod bench;
pub mod cluster;
pub mod consume;
pub mod credentials;
pub mod payload;
pub mod produce;
pub mod prometheus;
pub mod ready;
pub mod status;
