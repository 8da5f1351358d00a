//! The client side of TLS (rustls with the `ring` provider), and the PEM helpers the node
//! reuses for its own certificates.
//!
//! A client trusts the CA certificates of one PEM file ([`client_connector`]) and verifies the
//! broker's certificate against the host it dialed ([`server_name_of`]); it presents no
//! certificate (clients authenticate with a token in `Hello`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::TlsConnector;

/// Errors of loading certificates and keys or building a TLS configuration.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read or holds nothing usable.
    #[error("cannot read {what} from {}: {message}", path.display())]
    Pem {
        /// What was expected (`CA certificates`, `certificate`, `private key`).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The reader's message.
        message: String,
    },
    /// rustls refused the material (e.g. the key does not match the certificate).
    #[error("TLS configuration: {0}")]
    Rustls(String),
}

/// The crypto provider of every TLS configuration here: rustls' `ring`.
pub fn crypto_provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A [`TlsError::Rustls`] from any rustls error.
pub fn rustls_error(e: impl std::fmt::Display) -> TlsError {
    TlsError::Rustls(e.to_string())
}

/// Reads every certificate of a PEM file (at least one).
///
/// Errors: [`TlsError::Pem`] naming the file.
pub fn load_certs(
    path: &Path,
    what: &'static str,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem_err = |message: String| TlsError::Pem {
        what,
        path: path.to_path_buf(),
        message,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| pem_err(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_err(e.to_string()))?;
    if certs.is_empty() {
        return Err(pem_err("no CERTIFICATE block".into()));
    }
    Ok(certs)
}

/// Reads the first private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
///
/// Errors: [`TlsError::Pem`] naming the file.
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::Pem {
        what: "private key",
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// The CA certificates of `ca_file` as a root store.
///
/// Errors: [`TlsError`] when the file cannot be read or a certificate is unusable.
pub fn root_store(ca_file: &Path) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in load_certs(ca_file, "CA certificates")? {
        roots.add(cert).map_err(|e| {
            TlsError::Rustls(format!("CA certificate in {}: {e}", ca_file.display()))
        })?;
    }
    Ok(roots)
}

/// A connector for clients: trusts the CA certificates of `ca_file` (no client certificate).
///
/// Errors: [`TlsError`] when the file cannot be read.
pub fn client_connector(ca_file: &Path) -> Result<TlsConnector, TlsError> {
    let roots = root_store(ca_file)?;
    let config = rustls::ClientConfig::builder_with_provider(crypto_provider())
        .with_safe_default_protocol_versions()
        .map_err(rustls_error)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(TlsConnector::from(Arc::new(config)))
}

/// The server name a client verifies for `addr` (`host:port`, `[v6]:port`): the host part, as
/// an IP address or a DNS name.
///
/// Errors: a message when the host is neither.
pub fn server_name_of(addr: &str) -> Result<ServerName<'static>, String> {
    let host = match addr.rsplit_once(':') {
        Some((h, _)) => h,
        None => addr,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_string())
        .map_err(|e| format!("{host:?} is not a TLS server name: {e}"))
}

/// Whether a read error is a TLS peer closing its socket without `close_notify` (rustls
/// reports it as `UnexpectedEof`): a process that exits or is killed does that, so it is an
/// ordinary close, not bad input.
pub fn is_unclean_close(e: &bmq_proto::FrameError) -> bool {
    matches!(e, bmq_proto::FrameError::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreadable_files_are_errors_naming_the_file() {
        // A missing or empty PEM file is an error with its path, not a panic.
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        let err = load_certs(&empty, "certificate").unwrap_err().to_string();
        assert!(err.contains("empty.pem"), "{err}");
        let err = load_key(&dir.path().join("none.pem"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("none.pem"), "{err}");
    }

    #[test]
    fn only_unexpected_eof_is_an_unclean_close() {
        // A missing close_notify is an ordinary close; other errors stay bad input.
        let eof = bmq_proto::FrameError::Io(std::io::ErrorKind::UnexpectedEof.into());
        assert!(is_unclean_close(&eof));
        let other = bmq_proto::FrameError::Io(std::io::ErrorKind::InvalidData.into());
        assert!(!is_unclean_close(&other));
    }

    #[test]
    fn server_names_from_addresses() {
        // Hosts of host:port addresses become IP or DNS server names.
        assert!(matches!(
            server_name_of("127.0.0.1:30101").unwrap(),
            ServerName::IpAddress(_)
        ));
        assert!(matches!(
            server_name_of("[::1]:1").unwrap(),
            ServerName::IpAddress(_)
        ));
        assert!(matches!(
            server_name_of("broker1:30101").unwrap(),
            ServerName::DnsName(_)
        ));
        assert!(server_name_of("bad host:1").is_err());
    }
}
