//! TLS (rustls with the `ring` provider) for the peer links and the client listener (issue 10).
//!
//! - **Peer links** are mutual TLS under the cluster CA (`[tls] ca_file`): each node presents
//!   `cert_file`/`key_file`, whose certificate must carry the DNS subject alternative name
//!   `node-<id>` ([`member_name`]) of its member id. The dialer verifies that the listener's
//!   certificate names the member it dialed; the listener verifies that the dialer's certificate
//!   chains to the CA and names the member id its `PeerHello` claims ([`certificate_names`]).
//!   Anything else closes the connection before any elector or metadata message is read.
//! - **Client listener** (`[tls] client_listener = true`, the default when `[tls]` is present):
//!   server-side TLS with the same node certificate; clients verify it against the CA and the
//!   host they dialed, so a node certificate also names the member's host (an IP address or a
//!   DNS name) and `localhost`.
//! - [`generate_dev_ca`] writes a development CA and one certificate per node (rcgen), what
//!   `bmqctl cluster up` uses. In production bring your own CA (README "Security").
//!
//! Certificates and keys are read once at start: rotation is a restart with new files.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::config::ConfigError;

/// `[tls]`: the cluster CA and this node's certificate and key (PEM files).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSettings {
    /// PEM file with the cluster CA certificate(s) every peer certificate must chain to.
    pub ca_file: PathBuf,
    /// PEM file with this node's certificate (then any intermediates); it names `node-<id>`.
    pub cert_file: PathBuf,
    /// PEM file with this node's private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// Whether the client listener speaks TLS too (with the same certificate). Default true.
    #[serde(default = "default_true")]
    pub client_listener: bool,
}

fn default_true() -> bool {
    true
}

impl TlsSettings {
    /// Checks that no path is empty (the files are read at start by [`PeerTls::load`]).
    ///
    /// Errors: [`ConfigError::Invalid`] on `tls.<field>`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (name, p) in [
            ("ca_file", &self.ca_file),
            ("cert_file", &self.cert_file),
            ("key_file", &self.key_file),
        ] {
            if p.as_os_str().is_empty() {
                return Err(ConfigError::Invalid {
                    field: format!("tls.{name}"),
                    message: "must not be empty".into(),
                });
            }
        }
        Ok(())
    }
}

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

/// A byte stream that is either plain TCP or TLS over TCP, as the codecs see it.
pub trait AsyncStream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> AsyncStream for T {}

/// A boxed [`AsyncStream`] (one type for plain and TLS connections).
pub type BoxedStream = Box<dyn AsyncStream>;

/// The DNS subject alternative name a node certificate carries for member `id`: `node-<id>`.
pub fn member_name(id: u32) -> String {
    format!("node-{id}")
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
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

/// Reads the first private key of a PEM file.
///
/// Errors: [`TlsError::Pem`] naming the file.
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::Pem {
        what: "private key",
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

fn root_store(ca_file: &Path) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in load_certs(ca_file, "CA certificates")? {
        roots.add(cert).map_err(|e| {
            TlsError::Rustls(format!("CA certificate in {}: {e}", ca_file.display()))
        })?;
    }
    Ok(roots)
}

fn rustls_err(e: impl std::fmt::Display) -> TlsError {
    TlsError::Rustls(e.to_string())
}

/// The TLS side of a node: the mutual-TLS acceptor and connector of the peer links, and the
/// acceptor of the client listener when it is enabled.
#[derive(Clone)]
pub struct PeerTls {
    /// Accepts peer connections; requires a client certificate chaining to the cluster CA.
    pub peer_acceptor: TlsAcceptor,
    /// Dials peers presenting this node's certificate; verifies the peer's against the CA.
    pub peer_connector: TlsConnector,
    /// Accepts client connections (no client certificate); `None` when
    /// `client_listener = false`.
    pub client_acceptor: Option<TlsAcceptor>,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerTls")
            .field("client_listener", &self.client_acceptor.is_some())
            .finish()
    }
}

impl PeerTls {
    /// Reads the CA, the certificate and the key, and builds the three configurations.
    ///
    /// Errors: [`TlsError::Pem`] for an unreadable file, [`TlsError::Rustls`] for a key that
    /// does not match its certificate or an unusable CA.
    pub fn load(settings: &TlsSettings) -> Result<PeerTls, TlsError> {
        let roots = Arc::new(root_store(&settings.ca_file)?);
        let certs = load_certs(&settings.cert_file, "certificate")?;
        let key = load_key(&settings.key_file)?;

        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
                .build()
                .map_err(rustls_err)?;
        let peer_server = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(rustls_err)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs.clone(), key.clone_key())
            .map_err(rustls_err)?;
        let peer_client = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(rustls_err)?
            .with_root_certificates(roots)
            .with_client_auth_cert(certs.clone(), key.clone_key())
            .map_err(rustls_err)?;
        let client_acceptor = if settings.client_listener {
            let server = rustls::ServerConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .map_err(rustls_err)?
                .with_no_client_auth()
                .with_single_cert(certs, key)
                .map_err(rustls_err)?;
            Some(TlsAcceptor::from(Arc::new(server)))
        } else {
            None
        };
        Ok(PeerTls {
            peer_acceptor: TlsAcceptor::from(Arc::new(peer_server)),
            peer_connector: TlsConnector::from(Arc::new(peer_client)),
            client_acceptor,
        })
    }
}

/// A connector for clients: trusts the CA certificates of `ca_file` (no client certificate).
///
/// Errors: [`TlsError`] when the file cannot be read.
pub fn client_connector(ca_file: &Path) -> Result<TlsConnector, TlsError> {
    let roots = root_store(ca_file)?;
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(rustls_err)?
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

/// Whether the end-entity certificate `cert` names `name` (a DNS subject alternative name;
/// the chain was already verified by the TLS handshake).
pub fn certificate_names(cert: &CertificateDer<'_>, name: &str) -> bool {
    let Ok(server_name) = ServerName::try_from(name) else {
        return false;
    };
    match rustls::server::ParsedCertificate::try_from(cert) {
        Ok(parsed) => rustls::client::verify_server_name(&parsed, &server_name).is_ok(),
        Err(_) => false,
    }
}

/// Whether a read error is a TLS peer closing its socket without `close_notify` (rustls
/// reports it as `UnexpectedEof`): a process that exits or is killed does that, so it is an
/// ordinary close, not bad input.
pub fn is_unclean_close(e: &bmq_proto::FrameError) -> bool {
    matches!(e, bmq_proto::FrameError::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof)
}

/// The files [`generate_dev_ca`] wrote.
#[derive(Debug, Clone)]
pub struct DevCaFiles {
    /// The CA certificate (clients pass it as `--tls-ca`).
    pub ca_cert: PathBuf,
    /// Per node id: its [`TlsSettings`].
    pub nodes: Vec<(u32, TlsSettings)>,
}

/// Writes a development CA and one certificate and key per node into `dir`:
/// `ca.pem`, `ca-key.pem`, `node-<id>.pem`, `node-<id>-key.pem` (keys mode 0600). Each node
/// certificate names `node-<id>`, the member's `host`, `localhost` and `127.0.0.1`. Every call
/// makes a new CA (clients read `ca.pem` again when they start).
///
/// `members`: `(id, host)` of every node. Errors: an I/O error naming the file, or an rcgen
/// error.
pub fn generate_dev_ca(dir: &Path, members: &[(u32, String)]) -> anyhow::Result<DevCaFiles> {
    use anyhow::Context as _;
    use rcgen::{
        BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose,
        IsCa, KeyPair, KeyUsagePurpose,
    };
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let ca_path = dir.join("ca.pem");
    let ca_key_path = dir.join("ca-key.pem");
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "bmq development CA");
    ca_params.distinguished_name = dn;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca_params.self_signed(&ca_key)?;
    write_file(&ca_path, ca_cert.pem().as_bytes(), false)?;
    write_file(&ca_key_path, ca_key.serialize_pem().as_bytes(), true)?;
    let mut nodes = Vec::new();
    for (id, host) in members {
        let mut names = vec![
            member_name(*id),
            "localhost".to_string(),
            "127.0.0.1".to_string(),
        ];
        if !names.contains(host) {
            names.push(host.clone());
        }
        let mut params = CertificateParams::new(names)?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, member_name(*id));
        params.distinguished_name = dn;
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &ca_cert, &ca_key)?;
        let cert_file = dir.join(format!("{}.pem", member_name(*id)));
        let key_file = dir.join(format!("{}-key.pem", member_name(*id)));
        write_file(&cert_file, cert.pem().as_bytes(), false)?;
        write_file(&key_file, key.serialize_pem().as_bytes(), true)?;
        nodes.push((
            *id,
            TlsSettings {
                ca_file: ca_path.clone(),
                cert_file,
                key_file,
                client_listener: true,
            },
        ));
    }
    Ok(DevCaFiles {
        ca_cert: ca_path,
        nodes,
    })
}

/// Writes `bytes` to `path`, mode 0600 when `secret`.
pub fn write_file(path: &Path, bytes: &[u8], secret: bool) -> anyhow::Result<()> {
    use anyhow::Context as _;
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    if secret {
        options.mode(0o600);
    }
    let mut f = options
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_ca_certificates_name_their_member_only() {
        // A generated node certificate names node-<id> and its host, never another member.
        let dir = tempfile::tempdir().unwrap();
        let files = generate_dev_ca(
            dir.path(),
            &[(1, "127.0.0.1".into()), (2, "broker2".into())],
        )
        .unwrap();
        let tls1 = &files.nodes[0].1;
        let cert1 = &load_certs(&tls1.cert_file, "certificate").unwrap()[0];
        assert!(certificate_names(cert1, "node-1"));
        assert!(!certificate_names(cert1, "node-2"));
        let cert2 = &load_certs(&files.nodes[1].1.cert_file, "certificate").unwrap()[0];
        assert!(certificate_names(cert2, "broker2"));
        assert!(!certificate_names(cert2, "node-1"));
        PeerTls::load(tls1).expect("generated files load");
    }

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
