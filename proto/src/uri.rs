//! Queue URIs: `bmq://<domain>/<queue>` (DESIGN.md §1, §8).
//!
//! The domain names the configuration a queue gets (limits, consistency, mode); the queue name is
//! free within the domain. [`QueueUri::parse`] checks the shape and the character sets, and
//! [`QueueUri`]'s `Display` prints the canonical form back, so `parse(s)?.to_string() == s` for
//! every valid `s`.

use std::fmt;
use std::str::FromStr;

/// The scheme prefix of every queue URI.
pub const URI_SCHEME: &str = "bmq://";
/// Longest domain name, in bytes.
pub const DOMAIN_LEN_MAX: usize = 128;
/// Longest queue name, in bytes.
pub const QUEUE_NAME_LEN_MAX: usize = 128;

/// Why a string is not a queue URI. Every variant carries the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UriError {
    /// The string does not start with `bmq://`.
    #[error("{input:?} is not a queue uri: it must start with \"bmq://\"")]
    MissingScheme {
        /// The input.
        input: String,
    },
    /// There is no `/` between the domain and the queue name.
    #[error("{input:?} is not a queue uri: expected bmq://<domain>/<queue>")]
    MissingQueue {
        /// The input.
        input: String,
    },
    /// The domain is empty or longer than [`DOMAIN_LEN_MAX`].
    #[error("{input:?}: domain length {length} is not within 1..={DOMAIN_LEN_MAX}")]
    DomainLength {
        /// The input.
        input: String,
        /// The domain's length in bytes.
        length: usize,
    },
    /// The queue name is empty or longer than [`QUEUE_NAME_LEN_MAX`].
    #[error("{input:?}: queue name length {length} is not within 1..={QUEUE_NAME_LEN_MAX}")]
    QueueLength {
        /// The input.
        input: String,
        /// The queue name's length in bytes.
        length: usize,
    },
    /// The domain contains a character outside `[A-Za-z0-9_.-]`.
    #[error(
        "{input:?}: domain contains invalid character {character:?} (allowed: A-Z a-z 0-9 _ . -)"
    )]
    DomainCharacter {
        /// The input.
        input: String,
        /// The first offending character.
        character: char,
    },
    /// The queue name contains a character outside `[A-Za-z0-9_.~-]` (a `/` included).
    #[error(
        "{input:?}: queue name contains invalid character {character:?} (allowed: A-Z a-z 0-9 _ . ~ -)"
    )]
    QueueCharacter {
        /// The input.
        input: String,
        /// The first offending character.
        character: char,
    },
}

/// A parsed queue URI `bmq://<domain>/<queue>`.
///
/// Invariant (when built by [`QueueUri::parse`]): `domain` matches `[A-Za-z0-9_.-]{1,128}` and
/// `name` matches `[A-Za-z0-9_.~-]{1,128}`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct QueueUri {
    /// The domain, e.g. `bmq.test`.
    pub domain: String,
    /// The queue name within the domain, e.g. `orders`.
    pub name: String,
}

fn domain_char_ok(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')
}

/// Whether `name` is a valid domain name: 1 to [`DOMAIN_LEN_MAX`] bytes of
/// `A-Z a-z 0-9 . _ -` (the one rule for domains, used by [`QueueUri::parse`] and by the
/// configuration's `[[domains]]`).
pub fn is_valid_domain_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= DOMAIN_LEN_MAX && name.chars().all(domain_char_ok)
}

fn queue_char_ok(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '~' | '-')
}

impl QueueUri {
    /// Parses `bmq://<domain>/<queue>`.
    ///
    /// Errors: [`UriError`] naming the input and what is wrong (scheme, missing queue part,
    /// length, first invalid character).
    ///
    /// ```
    /// use bmq_proto::uri::QueueUri;
    /// let uri = QueueUri::parse("bmq://bmq.test/orders").unwrap();
    /// assert_eq!(uri.domain, "bmq.test");
    /// assert_eq!(uri.name, "orders");
    /// assert_eq!(uri.to_string(), "bmq://bmq.test/orders");
    /// ```
    pub fn parse(s: &str) -> Result<QueueUri, UriError> {
        let input = || s.to_string();
        let rest = s
            .strip_prefix(URI_SCHEME)
            .ok_or_else(|| UriError::MissingScheme { input: input() })?;
        let (domain, name) = rest
            .split_once('/')
            .ok_or_else(|| UriError::MissingQueue { input: input() })?;
        if domain.is_empty() || domain.len() > DOMAIN_LEN_MAX {
            return Err(UriError::DomainLength {
                input: input(),
                length: domain.len(),
            });
        }
        if let Some(character) = domain.chars().find(|c| !domain_char_ok(*c)) {
            return Err(UriError::DomainCharacter {
                input: input(),
                character,
            });
        }
        if name.is_empty() || name.len() > QUEUE_NAME_LEN_MAX {
            return Err(UriError::QueueLength {
                input: input(),
                length: name.len(),
            });
        }
        if let Some(character) = name.chars().find(|c| !queue_char_ok(*c)) {
            return Err(UriError::QueueCharacter {
                input: input(),
                character,
            });
        }
        Ok(QueueUri {
            domain: domain.to_string(),
            name: name.to_string(),
        })
    }
}

impl FromStr for QueueUri {
    type Err = UriError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        QueueUri::parse(s)
    }
}

impl fmt::Display for QueueUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{URI_SCHEME}{}/{}", self.domain, self.name)
    }
}

/// The queue URI of a per-message frame (`Put`, `Ack`, `Push`, `Confirm` in the client
/// protocol; `StoredMessage`, `StoredConfirm`, `StoredFailure`, `StoredRemoval`,
/// `StoredDelivery` in the journal). These fields are protobuf `bytes`, the same wire encoding
/// as `string` (field type 2, length-delimited), so clients and journals are unchanged; decoded
/// from a frame they share the frame's buffer and cloning them counts a reference, where a
/// `String` cost a heap allocation at every decode and clone (12 to 14 per message across the
/// brokers). They are not checked for UTF-8 at decode: a URI is looked up as bytes or through
/// [`uri_str`], and a name that is not UTF-8 matches no open queue.
pub type UriBytes = bytes::Bytes;

/// The URI bytes of `uri` (one copy; for frames built from a `&str`).
pub fn uri_bytes(uri: &str) -> UriBytes {
    bytes::Bytes::copy_from_slice(uri.as_bytes())
}

/// `uri` as text, or `None` when it is not UTF-8 (then it names no queue).
pub fn uri_str(uri: &[u8]) -> Option<&str> {
    std::str::from_utf8(uri).ok()
}

/// `uri` as text for logs and error messages (bytes that are not UTF-8 are replaced by U+FFFD).
pub fn uri_text(uri: &[u8]) -> std::borrow::Cow<'_, str> {
    String::from_utf8_lossy(uri)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_uris_round_trip() {
        // Valid URIs parse into their parts and print back identically.
        for s in [
            "bmq://bmq.test/q",
            "bmq://a/b",
            "bmq://my-domain_1.x/queue~name.v2-_",
            &format!("bmq://{}/{}", "d".repeat(128), "q".repeat(128)),
        ] {
            let uri = QueueUri::parse(s).unwrap();
            assert_eq!(uri.to_string(), s);
            assert_eq!(s.parse::<QueueUri>().unwrap(), uri);
        }
        let uri = QueueUri::parse("bmq://bmq.test/orders").unwrap();
        assert_eq!(
            uri,
            QueueUri {
                domain: "bmq.test".into(),
                name: "orders".into()
            }
        );
    }

    #[test]
    fn scheme_and_shape_errors() {
        // A missing scheme or missing queue part is named in the error with the input.
        let err = QueueUri::parse("http://a/b").unwrap_err();
        assert_eq!(
            err,
            UriError::MissingScheme {
                input: "http://a/b".into()
            }
        );
        assert!(err.to_string().contains("http://a/b"), "{err}");
        assert_eq!(
            QueueUri::parse("bmq://domain").unwrap_err(),
            UriError::MissingQueue {
                input: "bmq://domain".into()
            }
        );
    }

    #[test]
    fn length_errors() {
        // Empty and over-long parts are refused with their length.
        assert_eq!(
            QueueUri::parse("bmq:///q").unwrap_err(),
            UriError::DomainLength {
                input: "bmq:///q".into(),
                length: 0
            }
        );
        assert_eq!(
            QueueUri::parse("bmq://d/").unwrap_err(),
            UriError::QueueLength {
                input: "bmq://d/".into(),
                length: 0
            }
        );
        let long = format!("bmq://{}/q", "d".repeat(129));
        assert!(matches!(
            QueueUri::parse(&long).unwrap_err(),
            UriError::DomainLength { length: 129, .. }
        ));
        let long = format!("bmq://d/{}", "q".repeat(129));
        assert!(matches!(
            QueueUri::parse(&long).unwrap_err(),
            UriError::QueueLength { length: 129, .. }
        ));
    }

    #[test]
    fn character_errors() {
        // The first character outside the allowed set is reported; `/` and `~` rules differ
        // between domain and queue.
        assert_eq!(
            QueueUri::parse("bmq://a~b/q").unwrap_err(),
            UriError::DomainCharacter {
                input: "bmq://a~b/q".into(),
                character: '~'
            }
        );
        assert_eq!(
            QueueUri::parse("bmq://d/a/b").unwrap_err(),
            UriError::QueueCharacter {
                input: "bmq://d/a/b".into(),
                character: '/'
            }
        );
        assert!(matches!(
            QueueUri::parse("bmq://d/q é").unwrap_err(),
            UriError::QueueCharacter { character: ' ', .. }
        ));
        assert!(matches!(
            QueueUri::parse("bmq://dé/q").unwrap_err(),
            UriError::DomainCharacter {
                character: 'é', ..
            }
        ));
    }
}
