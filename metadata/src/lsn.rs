//! The Leader Sequence Number (BlazingMQ article, "Leader Sequence Numbers"; DESIGN.md §5).

use std::fmt;

use bmq_proto::{peer, Term};

/// A Leader Sequence Number: `(term, sequence)`, ordered lexicographically, printed `term:seq`.
///
/// A new leader of `term` starts at `(term, 0)`; its first record, the `LeaderAdvisory` snapshot,
/// is `(term, 1)`; every later record of that leader (advisories and commit records alike) takes
/// the next sequence. So a record of a newer term always orders after any record of an older one,
/// which is how stale leaders' messages are recognised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn {
    /// The term of the leader that stamped the record (compared first).
    pub term: Term,
    /// Position within the term, starting at 1 for the leader's snapshot.
    pub sequence: u64,
}

impl Lsn {
    /// The LSN before anything was ever written: `0:0`.
    pub const ZERO: Lsn = Lsn {
        term: Term(0),
        sequence: 0,
    };

    /// An LSN from its parts.
    pub fn new(term: Term, sequence: u64) -> Self {
        Lsn { term, sequence }
    }

    /// The next LSN in the same term.
    pub fn next(self) -> Self {
        Lsn {
            term: self.term,
            sequence: self.sequence + 1,
        }
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.term, self.sequence)
    }
}

/// JSON form: the string `term:seq` (the `/status` document's `version` of the domains).
impl serde::Serialize for Lsn {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl From<peer::Lsn> for Lsn {
    fn from(lsn: peer::Lsn) -> Self {
        Lsn {
            term: Term(lsn.term),
            sequence: lsn.sequence,
        }
    }
}

impl From<Lsn> for peer::Lsn {
    fn from(lsn: Lsn) -> Self {
        peer::Lsn {
            term: lsn.term.0,
            sequence: lsn.sequence,
        }
    }
}

/// Reads an optional wire LSN; a missing field is `0:0` (proto3 default).
pub(crate) fn lsn_of(lsn: Option<peer::Lsn>) -> Lsn {
    lsn.map(Lsn::from).unwrap_or(Lsn::ZERO)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsn_orders_by_term_then_sequence() {
        // Scenario: the article's example, (5, 2) is newer than (4, 1000).
        let old = Lsn::new(Term(4), 1000);
        let new = Lsn::new(Term(5), 2);
        assert!(new > old);
        assert!(Lsn::new(Term(5), 1) < new);
        assert_eq!(Lsn::new(Term(5), 2), new);
        assert!(Lsn::ZERO < Lsn::new(Term(0), 1));
        assert_eq!(new.next(), Lsn::new(Term(5), 3));
    }

    #[test]
    fn lsn_displays_and_converts() {
        // Scenario: an LSN prints as term:seq and survives a round trip through the wire type.
        let lsn = Lsn::new(Term(7), 42);
        assert_eq!(lsn.to_string(), "7:42");
        let wire: peer::Lsn = lsn.into();
        assert_eq!(
            wire,
            peer::Lsn {
                term: 7,
                sequence: 42
            }
        );
        assert_eq!(Lsn::from(wire), lsn);
        assert_eq!(lsn_of(None), Lsn::ZERO);
    }
}
