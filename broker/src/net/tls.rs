//! TLS (rustls with the `ring` provider) on the node side.
//!
//! - **Peer links** are mutual TLS under the cluster CA (`[tls] ca_file`): each node presents
//!   `cert_file`/`key_file`, whose certificate must carry the DNS subject alternative name
//!   `node-<id>` ([`bmq_proto::member_name`]) of its member id. The dialer verifies that the
//!   listener's certificate names the member it dialed; the listener verifies that the dialer's
//!   certificate chains to the CA and names the member id its `PeerHello` claims
//!   ([`certificate_names`]). Anything else closes the connection before any elector or
//!   metadata message is read.
//! - **Client listener** (`[tls] client_listener = true`, the default when `[tls]` is present):
//!   server-side TLS with the same node certificate; clients verify it against the CA and the
//!   host they dialed, so a node certificate also names the member's host (an IP address or a
//!   DNS name) and `localhost`.
//!
//! The PEM helpers are the client library's ([`bmq_client::tls`]). Certificates, keys and the
//! CA are read at start and again by a reload ([`PeerTls::reload`]: `bmqctl admin reload`,
//! SIGHUP): new connections use the new files, established ones keep what they negotiated.

use std::sync::{Arc, RwLock};

use bmq_client::tls::{crypto_provider, load_certs, load_key, root_store, rustls_error, TlsError};
use bmq_config::TlsSettings;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::sign::CertifiedKey;
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// The TLS side of a node: the mutual-TLS acceptor and connector of the peer links, and the
/// acceptor of the client listener when it is enabled.
///
/// Every configuration here takes the node's certificate and the CA's verifiers from one
/// shared [`TlsMaterial`] at each handshake, so [`PeerTls::reload`] changes what new
/// connections present and accept, on every clone, while established connections go on with
/// what they negotiated.
#[derive(Clone)]
pub struct PeerTls {
    /// Accepts peer connections; requires a client certificate chaining to the cluster CA.
    pub peer_acceptor: TlsAcceptor,
    /// Dials peers presenting this node's certificate; verifies the peer's against the CA.
    pub peer_connector: TlsConnector,
    /// Dials a `join` address, whose member id is not known yet: as `peer_connector`, but the
    /// listener's certificate may name any member (`node-<id>`; [`AnyMemberVerifier`]). The
    /// caller checks that it names the id the listener's hello claims.
    pub join_connector: TlsConnector,
    /// Accepts client connections (no client certificate); `None` when
    /// `client_listener = false`.
    pub client_acceptor: Option<TlsAcceptor>,
    /// The certificate, key and CA every configuration above reads at each handshake.
    material: Arc<TlsMaterial>,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerTls")
            .field("client_listener", &self.client_acceptor.is_some())
            .finish()
    }
}

impl PeerTls {
    /// Reads the CA, the certificate and the key, and builds the four configurations.
    ///
    /// Errors: [`TlsError::Pem`] for an unreadable file, [`TlsError::Rustls`] for a key that
    /// does not match its certificate or an unusable CA.
    pub fn load(settings: &TlsSettings) -> Result<PeerTls, TlsError> {
        let material = Arc::new(TlsMaterial::new(TlsFiles::read(settings)?));
        let peer_server = rustls::ServerConfig::builder_with_provider(crypto_provider())
            .with_safe_default_protocol_versions()
            .map_err(rustls_error)?
            .with_client_cert_verifier(Arc::new(CurrentClientVerifier(material.clone())))
            .with_cert_resolver(Arc::new(CurrentCertificate(material.clone())));
        let peer_client = rustls::ClientConfig::builder_with_provider(crypto_provider())
            .with_safe_default_protocol_versions()
            .map_err(rustls_error)?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(CurrentServerVerifier(material.clone())))
            .with_client_cert_resolver(Arc::new(CurrentCertificate(material.clone())));
        let any_member = AnyMemberVerifier {
            inner: CurrentServerVerifier(material.clone()),
        };
        let join_client = rustls::ClientConfig::builder_with_provider(crypto_provider())
            .with_safe_default_protocol_versions()
            .map_err(rustls_error)?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(any_member))
            .with_client_cert_resolver(Arc::new(CurrentCertificate(material.clone())));
        let client_acceptor = if settings.client_listener {
            let server = rustls::ServerConfig::builder_with_provider(crypto_provider())
                .with_safe_default_protocol_versions()
                .map_err(rustls_error)?
                .with_no_client_auth()
                .with_cert_resolver(Arc::new(CurrentCertificate(material.clone())));
            Some(TlsAcceptor::from(Arc::new(server)))
        } else {
            None
        };
        Ok(PeerTls {
            peer_acceptor: TlsAcceptor::from(Arc::new(peer_server)),
            peer_connector: TlsConnector::from(Arc::new(peer_client)),
            join_connector: TlsConnector::from(Arc::new(join_client)),
            client_acceptor,
            material,
        })
    }

    /// Reads the files of `settings` again and, if they are all usable, makes every
    /// configuration of this `PeerTls` (and of its clones) present the new certificate and
    /// trust the new CA from the next handshake on. `settings.client_listener` is not
    /// looked at: a listener is TLS or plain from the start.
    ///
    /// Returns the fingerprints before and after. Errors: as [`PeerTls::load`]; nothing
    /// changes then.
    pub fn reload(
        &self,
        settings: &TlsSettings,
    ) -> Result<(TlsFingerprints, TlsFingerprints), TlsError> {
        let files = TlsFiles::read(settings)?;
        let after = files.fingerprints.clone();
        let before = self.material.replace(files);
        Ok((before, after))
    }

    /// The fingerprints of the certificate and the CA in use.
    pub fn fingerprints(&self) -> TlsFingerprints {
        self.material.current().fingerprints.clone()
    }
}

/// What identifies the TLS files in use, for logs and the reload's answer (no key material).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFingerprints {
    /// SHA-256 of this node's (end-entity) certificate, lowercase hex.
    pub certificate_sha256: String,
    /// SHA-256 of each CA certificate of `ca_file`, in file order, lowercase hex.
    pub ca_sha256: Vec<String>,
}

/// SHA-256 of `data` in lowercase hex (the `ring` provider's, through rustls).
pub fn sha256_hex(data: &[u8]) -> String {
    let rustls::SupportedCipherSuite::Tls13(suite) =
        rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256
    else {
        unreachable!("TLS13_AES_128_GCM_SHA256 is a TLS 1.3 suite");
    };
    let digest = suite.common.hash_provider.hash(data);
    digest.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// The parsed contents of the `[tls]` files: the certificate with its key, the CA's
/// verifiers, and their fingerprints.
struct TlsFiles {
    certified: Arc<CertifiedKey>,
    client_verifier: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    server_verifier: Arc<rustls::client::WebPkiServerVerifier>,
    fingerprints: TlsFingerprints,
}

impl TlsFiles {
    /// Reads and checks the three files of `settings`.
    fn read(settings: &TlsSettings) -> Result<TlsFiles, TlsError> {
        let ca = load_certs(&settings.ca_file, "CA certificates")?;
        let roots = Arc::new(root_store(&settings.ca_file)?);
        let certs = load_certs(&settings.cert_file, "certificate")?;
        let key = load_key(&settings.key_file)?;
        let fingerprints = TlsFingerprints {
            certificate_sha256: sha256_hex(&certs[0]),
            ca_sha256: ca.iter().map(|c| sha256_hex(c)).collect(),
        };
        // `from_der` refuses a key that does not match the certificate.
        let certified =
            CertifiedKey::from_der(certs, key, &crypto_provider()).map_err(rustls_error)?;
        let client_verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots.clone(),
            crypto_provider(),
        )
        .build()
        .map_err(rustls_error)?;
        let server_verifier =
            rustls::client::WebPkiServerVerifier::builder_with_provider(roots, crypto_provider())
                .build()
                .map_err(rustls_error)?;
        Ok(TlsFiles {
            certified: Arc::new(certified),
            client_verifier,
            server_verifier,
            fingerprints,
        })
    }
}

/// The TLS files in use, shared by every configuration of a [`PeerTls`] and replaced whole
/// by a reload. A handshake takes the lock for the time of a clone of an `Arc`.
pub struct TlsMaterial {
    current: RwLock<Arc<TlsFiles>>,
}

impl TlsMaterial {
    fn new(files: TlsFiles) -> TlsMaterial {
        TlsMaterial {
            current: RwLock::new(Arc::new(files)),
        }
    }

    fn current(&self) -> Arc<TlsFiles> {
        // A poisoned lock still holds a whole `Arc` (it is only ever replaced whole).
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Puts `files` in use; returns the fingerprints of those they replace.
    fn replace(&self, files: TlsFiles) -> TlsFingerprints {
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        let before = current.fingerprints.clone();
        *current = Arc::new(files);
        before
    }
}

/// This node's certificate as it is now, for the listeners (server side) and the dialers
/// (client side).
#[derive(Debug)]
struct CurrentCertificate(Arc<TlsMaterial>);

impl std::fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsMaterial")
            .field("fingerprints", &self.current().fingerprints)
            .finish()
    }
}

impl rustls::server::ResolvesServerCert for CurrentCertificate {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current().certified.clone())
    }
}

impl rustls::client::ResolvesClientCert for CurrentCertificate {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[rustls::SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        // The one certificate, whatever the listener hints: it is the only one this node has.
        Some(self.0.current().certified.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// The CA's verifier of client certificates as it is now (the peer listener's).
#[derive(Debug)]
struct CurrentClientVerifier(Arc<TlsMaterial>);

impl rustls::server::danger::ClientCertVerifier for CurrentClientVerifier {
    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        // No hints: they would borrow from material a reload can replace, and every dialer of
        // this cluster presents its one certificate whatever the hints say.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        self.0
            .current()
            .client_verifier
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0
            .current()
            .client_verifier
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0
            .current()
            .client_verifier
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.current().client_verifier.supported_verify_schemes()
    }
}

/// The CA's verifier of server certificates as it is now (the peer dialers').
#[derive(Debug)]
pub struct CurrentServerVerifier(Arc<TlsMaterial>);

impl rustls::client::danger::ServerCertVerifier for CurrentServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        self.0.current().server_verifier.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0
            .current()
            .server_verifier
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0
            .current()
            .server_verifier
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.current().server_verifier.supported_verify_schemes()
    }
}

/// Verifies a listener's certificate as the peer dialer does (its chain to the cluster CA, its
/// validity, that it names a member), for a dial whose member id is not known: the name
/// checked is the first `node-<id>` the certificate carries, not the dialed one. Signatures are
/// checked by the standard verifier.
#[derive(Debug)]
pub struct AnyMemberVerifier {
    inner: CurrentServerVerifier,
}

/// The first `node-<id>` DNS name of the end-entity certificate `cert`, unverified (the
/// verifier then checks the certificate for that name).
pub fn member_name_in(cert: &CertificateDer<'_>) -> Option<String> {
    let parsed = webpki::EndEntityCert::try_from(cert).ok()?;
    let name = parsed.valid_dns_names().find(|n| {
        n.strip_prefix("node-")
            .is_some_and(|id| id.parse::<u32>().is_ok())
    });
    name.map(str::to_string)
}

impl rustls::client::danger::ServerCertVerifier for AnyMemberVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let name = member_name_in(end_entity).ok_or(rustls::Error::InvalidCertificate(
            rustls::CertificateError::NotValidForName,
        ))?;
        let name = ServerName::try_from(name).map_err(|_| {
            rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName)
        })?;
        self.inner
            .verify_server_cert(end_entity, intermediates, &name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_ca_certificates_name_their_member_only() {
        // A generated node certificate names node-<id> and its host, never another member.
        let dir = tempfile::tempdir().unwrap();
        let files = bmqctl::dev_ca::generate_dev_ca(
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
        assert_eq!(member_name_in(cert1).as_deref(), Some("node-1"));
        assert_eq!(member_name_in(cert2).as_deref(), Some("node-2"));
        PeerTls::load(tls1).expect("generated files load");
    }

    #[test]
    fn a_reload_swaps_the_certificate_and_a_bad_key_changes_nothing() {
        // A renewed certificate (new key, same CA) is taken; a key of another certificate is
        // refused and the one in use stays.
        let dir = tempfile::tempdir().unwrap();
        let files =
            bmqctl::dev_ca::generate_dev_ca(dir.path(), &[(1, "127.0.0.1".into())]).unwrap();
        let settings = files.nodes[0].1.clone();
        let tls = PeerTls::load(&settings).unwrap();
        let first = tls.fingerprints();
        let clone = tls.clone();
        let renewed = bmqctl::dev_ca::issue_node_cert(dir.path(), 1, "127.0.0.1").unwrap();
        let (before, after) = tls.reload(&renewed).unwrap();
        assert_eq!(before, first);
        assert_ne!(after.certificate_sha256, first.certificate_sha256);
        assert_eq!(after.ca_sha256, first.ca_sha256);
        assert_eq!(clone.fingerprints(), after, "clones share the material");
        let other = bmqctl::dev_ca::issue_node_cert(dir.path(), 2, "127.0.0.1").unwrap();
        let mismatched = TlsSettings {
            key_file: other.key_file,
            ..renewed
        };
        assert!(tls.reload(&mismatched).is_err());
        assert_eq!(tls.fingerprints(), after);
    }
}
