//! The one error type of loading and validating a configuration: every variant names the file
//! or the field path (`members[2].peer_port`) and the value.

use std::path::PathBuf;

/// Errors of loading or validating a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read configuration file {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The text is not valid TOML or does not match the schema (unknown field, wrong type).
    #[error("cannot parse configuration {}: {message}", path.display())]
    Parse {
        /// The file; `<string>` when parsed from a string by [`BrokerConfig::from_toml_str`].
        path: PathBuf,
        /// The parser's message, with line and column.
        message: String,
    },
    /// A value is out of range or inconsistent with another one.
    #[error("{field}: {message}")]
    Invalid {
        /// Path of the offending field, e.g. `members[2].peer_port`.
        field: String,
        /// What is wrong, naming the value, e.g. `0 is not a valid port`.
        message: String,
    },
    /// A file parsed but did not validate ([`BrokerConfig::load`]).
    #[error("invalid configuration {}: {field}: {message}", path.display())]
    InvalidFile {
        /// The file.
        path: PathBuf,
        /// Path of the offending field, e.g. `members[2].peer_port`.
        field: String,
        /// What is wrong, naming the value.
        message: String,
    },
}

impl ConfigError {
    /// The offending field path of a validation error (`Invalid` or `InvalidFile`).
    pub fn field(&self) -> Option<&str> {
        match self {
            ConfigError::Invalid { field, .. } | ConfigError::InvalidFile { field, .. } => {
                Some(field)
            }
            _ => None,
        }
    }

    /// A validation error on `field` (a path such as `members[2].peer_port`).
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }
}
